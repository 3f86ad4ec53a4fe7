"""ttt: meta-learning and test-time training on models whose attention can be differentiated twice.

Layout
    ttt.models        decoder-only transformer and small MLP; one attention switch for all of them
    ttt.inner         the inner-loop engine: `inner_step` (step.py, every inner gradient), differentiable
                      optimizers, `InnerLoop.step` / `InnerLoop.adapt`, `meta_step`
    ttt.meta          the outer step `OuterLearner` (learner.py), `MetaLearner` on it, `TaskDataModule`
    ttt.learners      ready-made MetaLearner subclasses (context test-time training, language models,
                      regression, optimizer comparison)
    ttt.layers        test-time-training layers: the chunked reader, TTT-E2E (`TTTTransformer`), the
                      transformers reader, the neural memory (`ttt.layers.neural_memory`)
    ttt.tasks         synthetic task generators (long-context key-value recall, sinusoid)
    ttt.text          local text corpora through Hugging Face datasets, no-download tokenizers
    ttt.second_order  Hessian-vector products, Hutchinson diagonals, Hessian optimizers
    ttt.config        typed configs and override checking (the recipes themselves: `recipes`)
    ttt.tracking      run directories, atomic checkpoints, timing, summaries
    ttt.experiments   measurements: GPU memory and time of meta steps, the paper-scale step, profiles
    ttt.train         the command line: `python -m ttt.train recipe=NAME key=value ...`
    ttt.load          a trained run back: `learner, cfg = ttt.load(RUN_DIR)` (ttt/meta/loading.py), then
                      `learner.adapt(task)` and `learner.predict(params, x)` (`ttt.meta.MetaLearner`)
    ttt.generate      a TTT-E2E run continues a prompt: `python -m ttt.generate RUN_DIR --prompt FILE ...`
                      (`ttt.layers.generation`: prefill, then decode with the inner steps)
    ttt.evaluate      loss by position of runs, with and without TTT: `python -m ttt.evaluate RUN_DIR ...`

The library never imports the app (`recipes`, `configs`, `ttt.train`) outside the command-line entry
points: `ttt.load` rebuilds a run's learner with the recipe book the app registers as an entry point
(pyproject.toml). To read first: ttt/inner/step.py (one inner step), ttt/meta/learner.py (one outer
step), and recipes/maml_sinusoid.py (a recipe: config, learner, data).
"""

from ._moved import install as _install_moved_names

_install_moved_names()


def __getattr__(name: str):
    # ttt.load imports torch and Lightning when first used, so that `import ttt` stays light.
    if name == "load":
        from .meta.loading import load

        return load
    raise AttributeError(f"module 'ttt' has no attribute {name!r}")
