"""Recipe configs (YAML), shipped as package data; `python -m ttt.train --help` lists them."""
