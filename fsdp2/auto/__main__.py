"""``python -m fsdp2.auto --plan plan.json --build-model package.module:function``: play an
``AutoPlan`` on PyTorch's fake process group at its world size and check it
(``fsdp2.auto.verify_plan``). ``auto_parallelize`` runs it in a fresh process with
``--payload``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import torch

from fsdp2.auto import AutoPlan, PlanCheck, verify_plan
from fsdp2.auto._proof import loss_from_payload


def main(argv=None) -> int:
    """``python -m fsdp2.auto``: check a plan file against a dry run of it.

    ``--plan plan.json --build-model package.module:function`` (a function building the
    model; it is called under ``torch.device("meta")``) plays ``--rank`` (repeatable;
    default the first and the last rank) and compares shard sizes, the layout and the
    collectives with the plan (``fsdp2.auto.verify_plan``); ``--json out.json`` writes the
    verdict. ``--payload`` is what ``auto_parallelize`` hands a fresh process (a
    ``torch.save`` file of the plan, the builder or a meta copy of the model, and the
    tensor-parallel plan, the step's loss function). Exit status 0: the plan holds; 1: it
    does not; 2: bad arguments (a plan file that does not read, say).

    Example:
        >>> main(["--plan", "plan.json", "--build-model", "mypkg.models:build_llama"])
        0
    """
    p = argparse.ArgumentParser(
        prog="python -m fsdp2.auto", description=main.__doc__.split("\n")[0]
    )
    p.add_argument("--plan", help="an AutoPlan JSON file (AutoPlan.to_json)")
    p.add_argument("--build-model", help="package.module:function building the model")
    p.add_argument("--payload", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, action="append", help="a simulated rank to play")
    p.add_argument("--json", help="write the verdict here")
    args = p.parse_args(argv)

    tp_plan, collectives = None, True
    if args.payload:
        payload = torch.load(args.payload, weights_only=False)
        plan = AutoPlan.from_json(payload["plan"])
        build = payload.get("build_model")
        if build is None:  # a pickled meta copy of the model
            build = torch.load(io.BytesIO(payload["model_bytes"]), weights_only=False)
        tp_plan = payload.get("tp_plan")
        collectives = payload.get("collectives", True)
    else:
        if not args.plan or not args.build_model:
            p.error("give --plan and --build-model (or --payload)")
        try:
            plan = AutoPlan.from_json(Path(args.plan).read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--plan {args.plan}: cannot read a plan there ({type(e).__name__}: {e})")
        build, payload = args.build_model, {}
    try:
        loss_fn = loss_from_payload(payload)
        check = verify_plan(plan, build, ranks=args.rank, tp_plan=tp_plan, loss_fn=loss_fn,
                            collectives=collectives)  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as e:  # the model or the plan: say which
        check = PlanCheck(False, [f"the dry run could not run: {type(e).__name__}: {e}"])
    if args.json:
        Path(args.json).write_text(json.dumps(check.to_dict()))
    print(check.summary(), file=sys.stdout if check.ok else sys.stderr)  # a CLI: it prints
    return 0 if check.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
