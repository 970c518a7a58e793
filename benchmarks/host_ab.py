"""Eager host time per call of the public ops at T = 1, for checkouts side by side.

    python benchmarks/host_ab.py --tree . --tree /tmp/old --rounds 5 --json ab.json

The host of a shared GPU machine moves ~1.5x within minutes, so figures of two
code versions compare only when measured in one run: each round times every
tree in a fresh process, in turn (the order reversed every other round), and
each call is also given as a multiple of torch.add measured in the same
process (the yardstick of the host's speed at that moment). Only the public
API is used, so any two versions compare.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

# One process per (tree, round): the median of 5 chunks of 2000 calls per op,
# after 200 warm-up calls; the GPU is drained outside the timed region.
CHILD = r"""
import json, time, torch, eagle_capture as ec
import os
H = int(os.environ["AB_HIDDEN"])
dev, dt = torch.device(os.environ["AB_DEVICE"]), torch.bfloat16
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
h, r = torch.randn(1, H, device=dev, dtype=dt), torch.randn(1, H, device=dev, dtype=dt)
w = torch.ones(H, device=dev, dtype=dt)
aux = torch.zeros(16, 3, H, device=dev, dtype=dt)
out, ro = torch.empty_like(h), torch.empty_like(h)
calls = {
    "torch.add(out=)": lambda: torch.add(h, r, out=out),
    "add_capture": lambda: ec.add_capture(h, r, aux, 1),
    "add_rmsnorm_capture": lambda: ec.add_rmsnorm_capture(h, r, w, 1e-6, aux, 2),
    "add_rmsnorm_into_slot": lambda: ec.add_rmsnorm_into_slot(h, r, w, 1e-6, aux, 0),
    "add_rmsnorm_out": lambda: ec.add_rmsnorm_out(h, r, w, 1e-6, ro),
}
result = {}
with torch.inference_mode():
    for name, fn in calls.items():
        for _ in range(200):
            fn()
        sync()
        chunks = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            chunks.append((time.perf_counter() - t0) * 1e6 / 2000)
            sync()
        result[name] = sorted(chunks)[2]
result["package"] = ec.__file__
print(json.dumps(result))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tree",
        action="append",
        required=True,
        help="a checkout (its eagle_capture package is imported); repeat",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run)")
    p.add_argument("--json", help="write every round's figures here")
    args = p.parse_args(argv)
    rounds = {tree: [] for tree in args.tree}
    for i in range(args.rounds):
        for tree in args.tree if i % 2 == 0 else args.tree[::-1]:
            env = dict(
                os.environ,
                PYTHONPATH=os.path.abspath(tree),
                AB_HIDDEN=str(args.hidden_size),
                AB_DEVICE=args.device,
            )
            run = subprocess.run(
                [sys.executable, "-c", CHILD],
                env=env,
                capture_output=True,
                text=True,
                cwd=os.path.abspath(tree),
            )
            if run.returncode != 0:
                sys.stderr.write(run.stderr)
                return 1
            rounds[tree].append(json.loads(run.stdout.strip().splitlines()[-1]))
    names = [n for n in rounds[args.tree[0]][0] if n != "package"]
    for tree in args.tree:
        print(f"{tree}: {rounds[tree][0]['package']}")
    print(
        f"host us per eager call, T = 1, H = {args.hidden_size} bf16: median over "
        f"{args.rounds} rounds (each the median of 5 chunks of 2000 calls)"
    )
    print(f"{'call':24s}" + "".join(f"{t[-19:]:>20s}{'x add':>8s}" for t in args.tree))
    for name in names:
        print(
            f"{name:24s}"
            + "".join(
                f"{statistics.median(r[name] for r in rounds[t]):20.2f}"
                f"{statistics.median(r[name] / r['torch.add(out=)'] for r in rounds[t]):8.2f}"
                for t in args.tree
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hidden_size": args.hidden_size, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
