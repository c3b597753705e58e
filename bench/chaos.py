"""A long fate-tracking SIGKILL storm (``shmq.testing.chaos``) from the command line.

Producers, consumers (two groups), a dead-letter queue's consumer, lock hogs and reapers
are SIGKILLed at random and replaced until ``--kills`` kills are done or ``--seconds``
have passed; then every group is drained and every message's fate is checked against the
processes' own logs: nothing confirmed lost, nothing invented, nothing stranded, no
corrupt payload, every exit status as expected, the invariant checker clean.  By default
one queue is journaled (``durability="interval"``), through a ``shmq serve`` started for
the run.

    .venv/bin/python bench/chaos.py --kills 1000 [--seconds 600] [--seed N] [--no-journal]

Prints progress lines and a one-paragraph summary; exits 1 if any check failed (the
children's logs are then kept, and the summary says where).  A failure is replayed, as
far as timing allows, with the same ``--seed``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from shmq.testing.chaos import run_storm, summary  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=1000, help="SIGKILLs to deliver (default 1000)")
    ap.add_argument("--seconds", type=float, default=600.0,
                    help="stop killing after this long even if the kills are not all done (default 600)")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the kills and workloads (default: random)")
    ap.add_argument("--no-journal", action="store_true",
                    help="no journaled queue (and no shmq serve): shared memory only")
    ap.add_argument("--gap", type=float, nargs=2, default=(0.002, 0.03), metavar=("MIN", "MAX"),
                    help="random pause between two kills, seconds (default 0.002 0.03)")
    ap.add_argument("--crash-share", type=float, default=0.3,
                    help="share of the children started with a crash point armed (default 0.3; 0: none)")
    ap.add_argument("--instance", default=None,
                    help="instance name (default chaos<pid>x0); destroyed at the end")
    ap.add_argument("--log-dir", default=None, help="keep the children's logs here (default: a temporary "
                                                    "folder, removed after a clean run)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"chaos: seed {seed}, up to {args.kills} kills in {args.seconds:g} s"
          f"{'' if args.no_journal else ', one journaled queue'}", flush=True)

    def say(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    r = run_storm(args.kills, args.seconds, seed, instance=args.instance, journal=not args.no_journal,
                  log_dir=args.log_dir, gap=tuple(args.gap), crash_share=args.crash_share, progress=say)
    print(summary(r), flush=True)
    if r.crash_deaths:
        print("  deaths at crash points: " + ", ".join(f"{n} {k}" for k, n in r.crash_deaths.most_common()))
    for f in r.groups:
        print(f"  {f.queue}/{f.group}: {f.confirmed} confirmed, {f.delivered} delivered "
              f"({f.deliveries} deliveries, {f.duplicates} duplicates), {f.drained} drained at the end, "
              f"{f.dead_lettered} dead-lettered, {f.in_flight} acks in flight at a kill; lost {len(f.lost)}, "
              f"delivered again after an ack {len(f.redelivered)}, "
              f"unexpected {len(f.unexpected)}, stranded {f.stranded}")
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
