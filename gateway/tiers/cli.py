"""`kvgate tiers train LABELLED.jsonl -o model.json` (needs the `tiers` extra)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import GatewayError


def register(sub: Any) -> None:
    tiers = sub.add_parser("tiers", help="tiered models: train the features classifier")
    tsub = tiers.add_subparsers(dest="tiers_command", required=True)
    p = tsub.add_parser(
        "train",
        help="fit the features classifier on labelled requests (JSONL) into a JSON model",
    )
    p.add_argument(
        "labelled", help="JSONL: a request body (or {'request': ...}) and 'label' a line"
    )
    p.add_argument("-o", "--output", required=True, help="where to write the JSON model")
    p.add_argument(
        "--test-share",
        type=float,
        default=0.2,
        help="share held out to report precision and recall on (default 0.2; 0: none)",
    )
    p.add_argument("--seed", type=int, default=0, help="the held-out split's seed")
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from gateway.tiers.train import read_labelled, train

    if not 0.0 <= args.test_share < 1.0:
        print("--test-share must be in [0, 1)", file=sys.stderr)
        return 2
    try:
        xs, ys = read_labelled(Path(args.labelled))
        trained = train(xs, ys, args.test_share, args.seed)
    except ImportError as exc:
        print(f"kvgate tiers train needs the tiers extra (scikit-learn): {exc}", file=sys.stderr)
        return 2
    except GatewayError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2
    try:
        Path(args.output).write_bytes(orjson.dumps(trained.model, option=orjson.OPT_INDENT_2))
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    hard = sum(ys)
    print(
        f"trained on {trained.train_rows} of {len(ys)} requests ({hard} hard); model: {args.output}"
    )
    for s in trained.test:
        print(
            f"held out, {s.label}: precision {s.precision:.3f} recall {s.recall:.3f}"
            f" (support {s.support})"
        )
    return 0
