"""Where the adaptive draft rule stops speculating: the crossover batch size.

Reads the start-up cost table a server logs with speculation on
(``speculation cost table (tokens: ms): 1: 3.5, 2: 3.7, ...``, from
``engine/llm_engine.py``) and asks :class:`AdaptiveDraftPolicy` (n-gram
drafting, which costs no model time) how many drafts it takes when ``B``
decoding requests, each with the same per-position acceptance ``a``, may each
draft up to ``k`` tokens. The crossover for ``a`` is the smallest ``B`` at which
it takes none. No model runs: this is the rule applied to a measured table.
Where the log also has the plain decode-step table (``plain decode step table
(sequences: ms): ...``: servers whose decode-only steps run the fused native
step), the rule prices the step without drafts by it, as the server does.

    python -m benchmarks.spec_crossover --log loadtest/results/spec-ngram.log
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from engine.spec_decode.controller import (
    PRIOR_ACCEPTANCE,
    PRIOR_WEIGHT,
    AdaptiveDraftPolicy,
    Candidate,
    StepCostModel,
)

LINE = re.compile(r"speculation cost table \(tokens: ms\): (.*?) \(measured")
PLAIN = re.compile(r"plain decode step table \(sequences: ms\): (.*)$", re.MULTILINE)


def _table(found: str) -> StepCostModel:
    return StepCostModel(
        [(int(n), float(ms) / 1e3) for n, ms in re.findall(r"(\d+): ([0-9.]+)", found)]
    )


def cost_table(log: Path) -> StepCostModel:
    """The last cost table the server logged."""
    found = LINE.findall(log.read_text())
    if not found:
        raise SystemExit(f"{log} has no 'speculation cost table' line")
    return _table(found[-1])


def plain_table(log: Path) -> StepCostModel | None:
    """The last plain decode-step table the server logged (None: it logged none)."""
    found = PLAIN.findall(log.read_text())
    return _table(found[-1]) if found else None


def drafts_taken(
    table: StepCostModel,
    batch: int,
    acceptance: float,
    k: int,
    plain: StepCostModel | None = None,
) -> int:
    """Drafts the rule takes for ``batch`` decoding requests measured at ``acceptance``."""
    policy = AdaptiveDraftPolicy(table, plain_cost=plain)
    for i in range(batch):
        rid = f"r{i}"
        policy.observe(rid, 0, 0)  # creates its record; then set it to the rate
        # As after many verifications at this rate (the prior no longer matters):
        # rate = (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT).
        acc = policy._acc[rid]
        acc.tried = 1000.0
        acc.accepted = acceptance * (acc.tried + PRIOR_WEIGHT) - PRIOR_ACCEPTANCE * PRIOR_WEIGHT
        assert abs(policy.acceptance(rid) - acceptance) < 1e-9
    return sum(policy.draft_counts([Candidate(f"r{i}", k) for i in range(batch)], batch, True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, required=True, help="a server log with the cost table")
    ap.add_argument("--k", type=int, default=4, help="drafts allowed per request")
    ap.add_argument("--acceptance", default="0.2,0.4,0.6,0.8,0.9")
    ap.add_argument("--batches", default="1,2,4,8,12,16,24,32,48,64")
    a = ap.parse_args(argv)
    table = cost_table(a.log)
    plain = plain_table(a.log)
    rates = [float(x) for x in a.acceptance.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    print("cost table (tokens: ms): " + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in table.points))
    if plain is not None:
        print(
            "plain decode steps (sequences: ms): "
            + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in plain.points)
        )
    print()
    print("| acceptance | " + " | ".join(f"B={b}" for b in batches) + " | crossover B |")
    print("|---|" + "---|" * (len(batches) + 1))
    for rate in rates:
        taken = [drafts_taken(table, b, rate, a.k, plain) for b in batches]
        cross = next((b for b, t in zip(batches, taken) if t == 0), None)
        print(
            f"| {rate:.1f} | "
            + " | ".join(str(t) for t in taken)
            + f" | {cross if cross is not None else f'> {batches[-1]}'} |"
        )
    print()
    print("Cells: drafts the rule takes in one step (of at most B x k).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
