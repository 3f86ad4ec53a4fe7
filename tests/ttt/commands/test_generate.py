"""`python -m ttt.generate` and `TextGenerator`: a trained run continues a prompt with the tokens of the
chunked read (greedy, inner steps at the run's learning rates, BOS before the prompt and masked as a
target), streamed as text; seeded sampling; and every bad input refused with exit status 2."""

import re
import shutil

import pytest
import torch
from tiny_configs import TINY_TRAINER

from ttt.generate import TextGenerator, main
from ttt.meta.loading import RECIPE_CONFIG
from ttt.text.tokenizer import ByteTokenizer
from ttt.text.train_tokenizer import train_tokenizer
from ttt.train import main as train

PROMPT = "def f1(x):\n    return x * 1\n" * 3  # 90 bytes and the BOS: 5 chunks of 16 and an open one
BOS = 256


def generate_command(capsys, *args):
    """(exit status, stdout, stderr) of python -m ttt.generate args."""
    capsys.readouterr()  # what came before (a fixture's training run) is not the command's
    try:
        status = main([str(arg) for arg in args])
    except SystemExit as exit_:  # argparse's errors
        status = exit_.code
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    return path


def chunked_read_greedily(model, tokens, new, lr_scale):
    """Greedy continuation by reading the whole sequence again for every token (`TTTTransformer.read`),
    BOS targets left out of the inner steps, stopping at BOS."""
    sequence = tokens
    for _ in range(new):
        mask = sequence[:, 1:] != BOS
        logits, _ = model.read(
            sequence, keep_logits=True, outer_grad=False, lr_scale=lr_scale, loss_mask=mask
        )
        token = logits[:, -1].argmax(-1)
        if int(token) == BOS:
            break
        sequence = torch.cat([sequence, token[:, None]], dim=1)
    return sequence[0, tokens.shape[1] :].tolist()


def test_the_command_streams_the_continuation_of_the_chunked_read(lm_run, prompt_file, capsys):
    generator = TextGenerator.load(lm_run)
    assert generator.bos == BOS and generator.lr_scale == pytest.approx(0.55)  # step 2 of a warm-up of 4
    tokens = generator.encode(PROMPT)
    assert tokens[0, 0] == BOS and tokens.shape == (1, 1 + len(PROMPT.encode()))
    expected = ByteTokenizer().decode(chunked_read_greedily(generator.model, tokens, 40, generator.lr_scale))
    status, out, err = generate_command(capsys, lm_run, "--prompt", prompt_file, "--max-new-tokens", 40)
    assert status == 0, err
    assert out == expected and len(out) > 0
    assert "".join(generator.stream(PROMPT, 40)) == expected
    status, out, err = generate_command(capsys, lm_run, "--prompt", prompt_file, "--max-new-tokens", 40,
                                        "--graphs", "on")  # fmt: skip
    assert status == 0 and out == expected, err
    without = "".join(generator.stream(PROMPT, 40, adapt=False))
    status, out, _ = generate_command(
        capsys, lm_run, "--prompt", prompt_file, "--max-new-tokens", 40, "--no-ttt"
    )
    assert out == without != expected


def test_sampling_is_seeded(lm_run, prompt_file, capsys):
    def sampled(seed):
        args = ["--temperature", 1.5, "--top-p", 0.9, "--seed", seed]
        status, out, err = generate_command(
            capsys, lm_run, "--prompt", prompt_file, "--max-new-tokens", 30, *args
        )
        assert status == 0, err
        return out

    assert sampled(3) == sampled(3) != sampled(4)


@pytest.fixture(scope="module")
def sinusoid_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sinusoid")
    overrides = ["recipe=maml_sinusoid", "model.hidden_sizes=[8,8]", *TINY_TRAINER]
    assert train([*overrides, f"run.root={root}", "run.name=sine"]) == 0
    return root / "sine"


@pytest.fixture
def mismatched_tokenizer_run(lm_run, tmp_path):
    """A copy of lm_run whose config names a tokenizer.json of more tokens (BOS, bytes and merges) than
    the model's 260."""
    run = shutil.copytree(lm_run, tmp_path / "mismatched")
    train_tokenizer(["def f(x):\n    return x\n"] * 10, 300).save(str(tmp_path / "tokenizer.json"))
    path = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["hyper_parameters"][RECIPE_CONFIG]["data"]["tokenizer"] = str(tmp_path / "tokenizer.json")
    torch.save(checkpoint, path)
    return run


@pytest.fixture
def full_attention_run(lm_run, tmp_path):
    """A copy of lm_run whose config turns its sliding window off (model.window null)."""
    run = shutil.copytree(lm_run, tmp_path / "full_attention")
    path = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["hyper_parameters"][RECIPE_CONFIG]["model"]["window"] = None
    torch.save(checkpoint, path)
    return run


@pytest.mark.parametrize(
    "case, message",
    [
        ("no checkpoint", "has no checkpoint"),
        ("not a TTT run", "generation runs a TTT-E2E model.*maml_sinusoid"),
        (
            "tokenizer too large",
            r"model.vocab_size \(260\) must be >= the tokenizer's vocabulary \(2[6-9]\d\) of data.tokenizer=",
        ),
        ("binary prompt", r"is not UTF-8 text \(byte 0xff at offset 3\)"),
        ("NUL in prompt", r"is not text \(a NUL byte at offset 2\)"),
        ("empty prompt", "is empty: nothing to continue"),
        ("no such prompt", "cannot be read"),
        ("max new tokens 0", "--max-new-tokens must be >= 1, got 0"),
        ("negative temperature", "--temperature must be >= 0"),
        ("top-p 0", r"--top-p must be in \(0, 1\]"),
        ("top-p above 1", r"--top-p must be in \(0, 1\]"),
        ("no such device", "--device 'nowhere' is not available"),
        ("graphs on full attention", "--graphs on needs a sliding-window model"),
    ],
)
def test_bad_input_exits_with_status_2_and_says_what_is_wrong(
    case, message, request, lm_run, prompt_file, tmp_path, capsys
):
    run, prompt, options = lm_run, prompt_file, []
    if case == "no checkpoint":
        run = shutil.copytree(lm_run, tmp_path / "no_checkpoint", ignore=shutil.ignore_patterns("*.ckpt"))
    elif case == "not a TTT run":
        run = request.getfixturevalue("sinusoid_run")
    elif case == "tokenizer too large":
        run = request.getfixturevalue("mismatched_tokenizer_run")
    elif case == "graphs on full attention":
        run = request.getfixturevalue("full_attention_run")
    elif case in ("binary prompt", "NUL in prompt", "empty prompt"):
        prompt = tmp_path / "prompt.bin"
        prompt.write_bytes(
            {"binary prompt": b"abc\xff\xfe", "NUL in prompt": b"ab\x00c", "empty prompt": b""}[case]
        )
    elif case == "no such prompt":
        prompt = tmp_path / "missing.txt"
    options = {
        "max new tokens 0": ["--max-new-tokens", 0],
        "negative temperature": ["--temperature", -1],
        "top-p 0": ["--top-p", 0],
        "top-p above 1": ["--top-p", 1.5],
        "no such device": ["--device", "nowhere"],
        "graphs on full attention": ["--graphs", "on"],
    }.get(case, [])
    status, out, err = generate_command(capsys, run, "--prompt", prompt, "--max-new-tokens", 5, *options)
    assert status == 2 and out == ""
    assert re.search(message, err) and "Traceback" not in err, err
