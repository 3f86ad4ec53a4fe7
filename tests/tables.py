"""Reading the markdown tables that the tools write, so that tests check their numbers rather than
their layout (tests/conftest.py's folder is on the import path: `from tables import markdown_tables`)."""


def markdown_tables(text: str) -> list[dict[str, dict[str, str]]]:
    """Every markdown table in `text`, in order, each as first cell -> {column header: cell}: the
    rows keyed by what they name, the cells stripped of padding."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        starts = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
        if not starts or i + 1 >= len(lines) or not lines[i + 1].startswith("|---"):
            continue
        header = [cell.strip() for cell in line.strip("|").split("|")]
        rows = {}
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            rows[cells[0]] = dict(zip(header, cells))
        tables.append(rows)
    return tables
