"""A trained learner used without a Trainer: `ttt.load(RUN_DIR)` and `load_from_checkpoint(path)` with no
arguments (a recipe's learner and a user subclass), then `adapt` and `predict`, which compute what
evaluation computes; and the errors of each."""

import json
import re
import shutil

import lightning.pytorch as pl
import pytest
import torch
from tiny_configs import TINY_TRAINER, tiny_text_run, write_tiny_corpus
from torch import nn

import recipes
import ttt
import ttt.meta.loading
from recipes import build
from ttt.config import ConfigError, OuterOptimConfig
from ttt.inner import InnerLoopConfig
from ttt.learners import ContextLearner, RegressionLearner
from ttt.learners.ttt_language_model import TTTLanguageLearner
from ttt.meta import MetaLearner, OuterLearner
from ttt.tracking import CheckpointError
from ttt.train import main

TINY_SINUSOID = ["recipe=maml_sinusoid", "model.hidden_sizes=[8,8]", "inner.eval_steps=3", *TINY_TRAINER]
"""A two-step maml_sinusoid run (4 test tasks in batches of 2, 3 inner steps at evaluation)."""


def run_and_keep_the_learner(overrides: list[str]) -> OuterLearner:
    """Run ttt.train with `overrides`; return the learner it built, as it was when saved and tested."""
    built = []

    def build_and_keep(cfg):
        learner, data = build(cfg)
        built.append(learner)
        return learner, data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recipes, "build", build_and_keep)
        assert main(overrides) == 0
    return built[0]


def held_out_batches(cfg) -> list[dict[str, torch.Tensor]]:
    """The test batches of a run's config, as its test read them."""
    _, data = build(cfg)
    data.setup("test")
    return list(data.test_dataloader())


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
        assert value.dtype == b.state_dict()[name].dtype, name


@pytest.fixture(scope="module")
def sinusoid_run(tmp_path_factory):
    """(the run directory of a tiny maml_sinusoid run, the learner it trained)."""
    root = tmp_path_factory.mktemp("runs")
    trained = run_and_keep_the_learner([*TINY_SINUSOID, f"run.root={root}", "run.name=sinusoid"])
    return root / "sinusoid", trained


def test_a_recipe_run_loads_with_no_arguments_as_the_learner_it_saved(sinusoid_run, tmp_path):
    run, trained = sinusoid_run
    learner, cfg = ttt.load(run)
    assert type(learner) is RegressionLearner and cfg.recipe == "maml_sinusoid"
    assert cfg.inner.eval_steps == 3 and cfg.model.hidden_sizes == [8, 8]
    assert not learner.training and learner.device == torch.device("cpu")
    assert learner.global_step == trained.global_step == 2
    checkpoint = run / "checkpoints" / "last.ckpt"
    by_class = RegressionLearner.load_from_checkpoint(checkpoint)
    by_base = MetaLearner.load_from_checkpoint(checkpoint)
    alone = shutil.copy(checkpoint, tmp_path / "copied.ckpt")  # the config is in the checkpoint itself
    assert ttt.load(alone)[1] == cfg
    task = {name: value[0] for name, value in held_out_batches(cfg)[0].items()}
    adapted = trained.adapt(task)
    expected = trained.predict(adapted, task["x_query"])
    for loaded in (learner, by_class, by_base, RegressionLearner.load_from_checkpoint(alone)):
        assert type(loaded) is RegressionLearner
        assert_same_state(loaded, trained)
        params = loaded.adapt(task)
        assert params.keys() == adapted.keys()
        assert all(torch.equal(params[name], adapted[name]) for name in adapted)
        assert torch.equal(loaded.predict(params, task["x_query"]), expected)


def test_adapt_and_predict_give_what_evaluation_computes_and_the_runs_test_loss(sinusoid_run):
    run, _ = sinusoid_run
    learner, cfg = ttt.load(run)
    batch_means = []
    for batch in held_out_batches(cfg):
        losses = []
        for i in range(len(batch["x_query"])):
            task = {name: value[i] for name, value in batch.items()}
            params = learner.adapt(task)
            initial = learner.initial_params()
            assert all(not torch.equal(params[name], initial[name]) for name in initial)
            prediction = learner.predict(params, task["x_query"])
            loss = (prediction - task["y_query"]).square().mean()
            one = {name: value[i : i + 1] for name, value in batch.items()}
            assert torch.equal(loss, learner.evaluate(one)["query_loss_adapted"])  # bitwise
            unadapted = (learner.predict(initial, task["x_query"]) - task["y_query"]).square().mean()
            assert torch.equal(unadapted, learner.evaluate(one)["query_loss_unadapted"])
            losses.append(loss)
        batch_means.append(torch.stack(losses).mean())
    summary = json.loads((run / "summary.json").read_text())
    assert torch.stack(batch_means).mean().item() == pytest.approx(summary["query_loss_adapted"], rel=1e-6)


def test_adapt_keeps_no_graph_and_works_under_no_grad_but_not_under_inference_mode(sinusoid_run):
    learner, cfg = ttt.load(sinusoid_run[0])
    task = {name: value[0] for name, value in held_out_batches(cfg)[0].items()}
    params = learner.adapt(task)
    with torch.no_grad():
        again = learner.adapt(task)
    assert all(torch.equal(again[name], params[name]) for name in params)
    assert all(not p.requires_grad and p.grad_fn is None for p in params.values())
    assert all(p.grad is None for p in learner.parameters())
    one_step = learner.adapt(task, steps=1)
    assert all(not torch.equal(one_step[name], params[name]) for name in params)
    assert all(torch.equal(v, learner.initial_params()[k]) for k, v in learner.adapt(task, steps=0).items())
    arrays = learner.adapt({name: value.numpy() for name, value in task.items()})  # as a sampler gives them
    assert all(torch.equal(arrays[name], params[name]) for name in params)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="torch.inference_mode"):
        learner.adapt(task)
    with pytest.raises(TypeError, match="task must be a non-empty dict of tensors"):
        learner.adapt([task["x_support"]])
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        learner.adapt(task, steps=-1)
    with pytest.raises(ValueError, match=r"not parameters of the model: \['nope'\]"):
        learner.predict({"nope": torch.zeros(1)}, task["x_query"])


class LineLearner(MetaLearner):
    """The documented pattern: the model is built in __init__ from plain values, which it saves."""

    def __init__(self, hidden: int = 8, inner_lr: float = 0.3, total_steps: int = 5):
        model = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        inner = InnerLoopConfig(params=["2.*"], steps=2, eval_steps=3, lr=inner_lr, learnable_lr="tensor")
        super().__init__(model, inner, OuterOptimConfig(lr=1e-2), total_steps)
        self.save_hyperparameters()

    def inner_loss(self, params, task, step):
        return (self.forward_with(params, task["x"]) - task["y"]).square().mean()

    def outer_loss(self, params, task):
        return (self.forward_with(params, task["xq"]) - task["yq"]).square().mean()


class PassedModelLearner(MetaLearner):
    """The pattern before: the model passed in, nothing saved."""

    inner_loss, outer_loss = LineLearner.inner_loss, LineLearner.outer_loss


def line_batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        slope, shift = torch.randn(2, 4, 1, 1, generator=gen)
        x, xq = torch.rand(4, 5, 1, generator=gen), torch.rand(4, 5, 1, generator=gen)
        batches.append({"x": x, "y": slope * x + shift, "xq": xq, "yq": slope * xq + shift})
    return batches


def fit_and_save(learner: MetaLearner, path) -> None:
    trainer = pl.Trainer(
        max_steps=5, inference_mode=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(learner, train_dataloaders=torch.utils.data.DataLoader(line_batches(5), batch_size=None))
    trainer.save_checkpoint(path)


def test_a_user_subclass_that_saves_its_hyperparameters_loads_with_no_arguments(tmp_path):
    torch.manual_seed(0)
    trained = LineLearner(hidden=6, inner_lr=0.2)
    fit_and_save(trained, tmp_path / "line.ckpt")
    loaded = LineLearner.load_from_checkpoint(tmp_path / "line.ckpt")
    assert loaded.hparams == {"hidden": 6, "inner_lr": 0.2, "total_steps": 5}
    assert not loaded.training and loaded.global_step == 5
    assert_same_state(loaded, trained)  # the learnable inner lrs too
    task = {name: value[0] for name, value in line_batches(1, seed=1)[0].items()}
    params, expected = loaded.adapt(task), trained.adapt(task)
    assert all(torch.equal(params[name], expected[name]) for name in expected)
    assert torch.equal(loaded.predict(params, task["xq"]), trained.predict(expected, task["xq"]))
    with pytest.raises(TypeError, match="cannot be called on an instance"):  # it would not load in place
        trained.load_from_checkpoint(tmp_path / "line.ckpt")
    with pytest.raises(CheckpointError, match="not written by a recipe run.*load_from_checkpoint"):
        ttt.load(tmp_path / "line.ckpt")


def test_a_subclass_that_saves_nothing_is_told_how_to_load(tmp_path):
    inner = InnerLoopConfig(params=["2.*"])
    trained = PassedModelLearner(nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)), inner,
                                 OuterOptimConfig(), 5)  # fmt: skip
    fit_and_save(trained, tmp_path / "passed.ckpt")
    missing = r"\['model', 'inner', 'optim'\].*save_hyperparameters"  # total_steps may come from the Trainer
    with pytest.raises(TypeError, match=missing):
        PassedModelLearner.load_from_checkpoint(tmp_path / "passed.ckpt")
    model = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    loaded = PassedModelLearner.load_from_checkpoint(
        tmp_path / "passed.ckpt", model=model, inner=inner, optim=OuterOptimConfig(), total_steps=5
    )
    assert_same_state(loaded, trained)


class DictLearner(MetaLearner):
    """Lightning's other pattern: one dict argument, saved as the hyperparameters."""

    inner_loss, outer_loss = LineLearner.inner_loss, LineLearner.outer_loss

    def __init__(self, hparams: dict):
        inner = InnerLoopConfig(params=["bias"], lr=hparams["inner_lr"])
        super().__init__(nn.Linear(1, 1), inner, OuterOptimConfig(), 5)
        self.save_hyperparameters(hparams)


def test_a_learner_that_saves_its_one_dict_argument_loads_with_no_arguments(tmp_path):
    trained = DictLearner({"inner_lr": 0.2})
    fit_and_save(trained, tmp_path / "dict.ckpt")
    loaded = DictLearner.load_from_checkpoint(tmp_path / "dict.ckpt")
    assert loaded.hparams == {"inner_lr": 0.2} and loaded.inner_cfg.lr == 0.2
    assert_same_state(loaded, trained)


def test_hyperparameters_a_checkpoint_cannot_hold_are_refused_when_saved():
    class ConfigTakingLearner(MetaLearner):
        def __init__(self, inner: InnerLoopConfig, hidden: int = 4):
            super().__init__(nn.Linear(1, hidden), inner, OuterOptimConfig(), 1)
            self.save_hyperparameters()

    with pytest.raises(TypeError, match=r"hyperparameters inner \(InnerLoopConfig\) are not plain values"):
        ConfigTakingLearner(InnerLoopConfig(params=["bias"]))


def test_loading_errors_name_the_path_and_what_to_do(sinusoid_run, tmp_path, monkeypatch):
    run, _ = sinusoid_run
    def at(path, text: str) -> str:
        return re.escape(str(path)) + text

    with pytest.raises(FileNotFoundError, match=at(tmp_path / "nothing", " does not exist")):
        ttt.load(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=at(tmp_path / "empty", " has no checkpoint")):
        ttt.load(tmp_path / "empty")
    checkpoint = run / "checkpoints" / "last.ckpt"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=at(truncated, " is truncated or corrupt")):
        ttt.load(truncated)
    with pytest.raises(CheckpointError, match=at(truncated, " is truncated or corrupt")):
        RegressionLearner.load_from_checkpoint(truncated)
    with pytest.raises(CheckpointError, match=r"a RegressionLearner \(recipe maml_sinusoid\), not a Context"):
        ContextLearner.load_from_checkpoint(checkpoint)
    with pytest.raises(TypeError, match="takes no keyword arguments \\(got total_steps\\)"):
        RegressionLearner.load_from_checkpoint(checkpoint, total_steps=3)

    saved = torch.load(checkpoint, weights_only=True)
    saved["hyper_parameters"]["recipe_config"]["builder"] = "elsewhere"
    torch.save(saved, tmp_path / "elsewhere.ckpt")
    with pytest.raises(ConfigError, match=at(tmp_path / "elsewhere.ckpt", ": .*builder must be one of")):
        ttt.load(tmp_path / "elsewhere.ckpt")
    saved["hyper_parameters"]["recipe_config"].update(builder="maml_sinusoid", model={"hidden_sizes": [4, 4]})
    torch.save(saved, tmp_path / "reshaped.ckpt")
    with pytest.raises(CheckpointError, match=at(tmp_path / "reshaped.ckpt", " does not fit the Regression")):
        ttt.load(tmp_path / "reshaped.ckpt")

    monkeypatch.setattr(ttt.meta.loading, "entry_points", lambda group: [])
    with pytest.raises(LookupError, match="no recipe book is registered.*pip install -e"):
        ttt.load(run)


def test_a_run_from_before_checkpoints_held_configs_loads_with_its_config_yaml(sinusoid_run, tmp_path):
    run, trained = sinusoid_run
    old = tmp_path / "old"
    shutil.copytree(run, old)
    saved = torch.load(old / "checkpoints" / "last.ckpt", weights_only=True)
    del saved["hyper_parameters"], saved["hparams_name"]
    torch.save(saved, old / "checkpoints" / "last.ckpt")
    learner, cfg = ttt.load(old)
    assert cfg.recipe == "maml_sinusoid"
    assert_same_state(learner, trained)
    assert_same_state(RegressionLearner.load_from_checkpoint(old / "checkpoints" / "last.ckpt"), trained)


def test_a_float64_context_learner_loads_in_float64(tiny_overrides, tmp_path):
    float64 = ["run.name=f64", "trainer.precision=64-true", "inner.learnable_lr=element"]
    trained = run_and_keep_the_learner(tiny_overrides("maml_longctx", *float64))
    learner, cfg = ttt.load(tmp_path / "f64")
    assert type(learner) is ContextLearner and learner.model.embed.weight.dtype == torch.float64
    assert_same_state(learner, trained)
    task = {name: value[0] for name, value in held_out_batches(cfg)[0].items()}
    one = {name: value[None] for name, value in task.items()}
    loss, metrics = learner.outer_loss(learner.adapt(task), task)
    assert torch.equal(metrics["query_loss"], learner.evaluate(one)["query_loss_adapted"])
    logits = learner.predict(learner.adapt(task), task["tokens"][None, :-1])
    assert logits.shape == (1, len(task["tokens"]) - 1, cfg.model.vocab_size)


def test_a_ttt_language_learner_loads_and_reads_with_the_inner_lr_warm_up_it_reached(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    overrides = tiny_text_run("ttt_e2e", corpus, tmp_path, "run.name=lm", "ttt.lr_warmup_steps=4")
    assert main(overrides) == 0
    learner, cfg = ttt.load(tmp_path / "lm")
    assert type(learner) is TTTLanguageLearner and learner.global_step == 2
    assert learner.inner_lr_scale() == cfg.ttt.lr_scale(2) != cfg.ttt.lr_scale(0)
    batches = held_out_batches(cfg)
    means = [learner.evaluate(batch)["query_loss_adapted"] for batch in batches]
    summary = json.loads((tmp_path / "lm" / "summary.json").read_text())
    assert torch.stack(means).mean().item() == pytest.approx(summary["query_loss_adapted"], rel=1e-6)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="read\\(adapt=True\\).*inference_mode"):
        learner.read(batches[0]["tokens"], adapt=True)
    with torch.no_grad():  # a read without inner steps runs under inference_mode too, to the same losses
        _, plain = learner.read(batches[0]["tokens"], adapt=False, keep_logits=False)
    with torch.inference_mode():
        _, inferred = learner.read(batches[0]["tokens"], adapt=False, keep_logits=False)
    assert torch.equal(inferred, plain)
