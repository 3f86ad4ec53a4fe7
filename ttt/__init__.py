"""ttt: meta-learning and test-time training on models whose attention can be differentiated twice.

Layout
    ttt.models       decoder-only transformer and small MLP; one attention switch for all of them
    ttt.inner        the inner-loop engine: `inner_step` (step.py, every inner gradient), differentiable
                     optimizers, `InnerLoop.step` / `InnerLoop.adapt`, `meta_step`
    ttt.meta         the outer step `OuterLearner` (learner.py), `MetaLearner` on it, `TaskDataModule`
    ttt.learners     ready-made MetaLearner subclasses (context test-time training, regression)
    ttt.tasks        synthetic task generators (long-context key-value recall, sinusoid)
    ttt.text         local text corpora through Hugging Face datasets, no-download tokenizers
    ttt.reading      the chunked-reading engine (`ChunkedReader`, `score_then_step`) under the two below
    ttt.ttt_layers   TTT-E2E transformer with fast-weight MLPs read chunk by chunk
    ttt.memory       Titans-style neural-memory transformer on the same engine
    ttt.config       typed configs, recipe loading and override checking
    ttt.tracking     run directories, atomic checkpoints, timing, summaries
    ttt.train        the command line: `python -m ttt.train recipe=NAME key=value ...`

To read first: ttt/inner/step.py (one inner step), ttt/meta/learner.py (one outer step), and
recipes/maml_sinusoid.py (a recipe: config, learner, data).
"""
