"""``python -m fsdp2.plan``: will this model fit on N GPUs, and with which layout?

The command line of the memory planner (``fsdp2.tools.planner``); ``fsdp2/plan/__main__.py``
prints the tables (rich). ``build_model`` is what it plans for.

Example:
    >>> from fsdp2.plan import build_model
    >>> model, tp_plan, label = build_model("gpt", params=7e9)
    >>> label
    'GPT (examples/gpt.py) dim 4096, 33 layers, 32 heads, vocab 32000: 6.92B parameters'
"""

from fsdp2.plan._models import build_model, gpt_config_for, llama_config_for, tp_plan_for

__all__ = ["build_model", "gpt_config_for", "llama_config_for", "tp_plan_for"]
