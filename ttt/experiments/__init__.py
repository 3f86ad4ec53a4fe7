"""Experiments built on the framework: `python -m ttt.experiments.grad_memory` measures the memory and time
of one meta step as context length and inner steps grow, per attention backend."""
