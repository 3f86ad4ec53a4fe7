"""ttt: meta-learning and test-time training on models whose attention can be differentiated twice.

Layout
    ttt.models      decoder-only transformer and small MLP; one attention switch for all of them
    ttt.inner       the inner-loop engine: differentiable optimizers, `adapt`, `meta_step`
    ttt.tasks       synthetic task generators, local-file corpora, a no-download tokenizer
    ttt.meta        the Lightning meta-learning module and data module
    ttt.config      typed configs, recipe loading and override checking
    ttt.tracking        run directories, atomic checkpoints, summaries
    ttt.train       the command line: `python -m ttt.train recipe=NAME key=value ...`
"""
