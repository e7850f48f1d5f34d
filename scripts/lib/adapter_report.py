"""Summarises a scripts/bench-adapter run: pickup latency per phase, throughput after the
Postgres restart, and the loss check. Usage: adapter_report.py OUT_DIR RATE"""
import json
import statistics
import sys
from datetime import datetime, timedelta

out, rate = sys.argv[1], float(sys.argv[2])


def when(s):
    return datetime.fromisoformat(s.strip().replace("Z", "+00:00"))


marks = {}
for line in open(f"{out}/marks"):
    name, at = line.split()
    marks[name] = when(at)
rows = [json.loads(l) for l in open(f"{out}/samples.jsonl") if l.strip()]
rows = [r for r in rows if r.get("kind") == "adapter"]


def values(metric, a, b):
    return [r["value"] for r in rows if r["metric"] == metric and a <= when(r["t"]) < b]


print(f"{'phase':<10} {'p50 ms':>8} {'p99 ms (median / worst)':>24} {'completed/s':>12} {'most waiting':>13}")
for name, a, b in [("clean", "start", "pinned"), ("pinned", "pinned", "recovery"), ("recovery", "recovery", "sigkill")]:
    # Each p99 is over a 30 s rolling window: leave out the first 30 s of a phase.
    lo, hi = marks[a] + timedelta(seconds=30), marks[b]
    p50, p99 = values("claim_p50_ms", lo, hi), values("claim_p99_ms", lo, hi)
    done, depth = values("completion_rate", lo, hi), values("queue_depth", lo, hi)
    if not p99:
        print(f"{name:<10} no samples")
        continue
    print(
        f"{name:<10} {statistics.median(p50):8.1f} {statistics.median(p99):11.1f} / {max(p99):8.1f}"
        f" {statistics.mean(done):12.0f} {max(depth) if depth else 0:13.0f}"
    )
# The dead tuples of the queue's partitions through the pin (no vacuum can remove any):
# the ring's slots together, jobs_long and jobs_done; and the ring's heap on disk.
dead = [l.split()[1:] for l in open(f"{out}/pin.out") if l.startswith("dead ")]
if dead:
    t0 = int(dead[0][0]) - 10
    print("dead tuples while pinned (s into the pin: ring slots / jobs_long / jobs_done, ring heap MiB):")
    print("  " + ", ".join(f"{int(t) - t0} s: {r} / {l} / {d}, {int(b) / 2**20:.1f}" for t, r, l, d, b in dead))
    print(f"  most in the ring's slots: {max(int(r) for _, r, _, _, _ in dead)}; in all the queue's partitions "
          f"at the end: {sum(int(x) for x in dead[-1][1:4])}")
else:
    print("dead tuples while pinned: no sample")

# Back to the offered rate: the first second after Postgres answers from which completions
# stay at 90 % of the rate or more for 5 s (catch-up above the rate counts).
back = marks["pg_back"]
ticks = sorted((when(r["t"]), r["value"]) for r in rows if r["metric"] == "completion_rate" and when(r["t"]) > back)
recovered = None
for i in range(len(ticks) - 4):
    if all(v >= 0.9 * rate for _, v in ticks[i : i + 5]):
        recovered = (ticks[i][0] - back).total_seconds()
        break
print(f"Postgres restart: down {(back - marks['pg_restart']).total_seconds():.1f} s; "
      f"throughput back to {rate:.0f}/s {'after %.1f s' % recovered if recovered is not None else 'NOT within 30 s'}")

lost = False
for line in open(f"{out}/loss"):
    run, distinct, expected, total, completed, waiting, again = line.split()
    # Committed jobs all present (no gap in the sequence, no duplicate row), and each one
    # completed or still waiting for a consumer (those in flight at the final SIGTERM).
    ok = distinct == expected == total and int(completed) + int(waiting) == int(total)
    lost |= not ok
    print(f"producer {run[:8]}: {total} jobs, sequence {'complete' if distinct == expected else 'GAPS'}, "
          f"{completed} completed, {waiting} waiting at the end, {again} run more than once")
print("loss check:", "FAILED" if lost else "no job lost")
print(open(f"{out}/pin.out").read().strip().splitlines()[-1])
sys.exit(1 if lost else 0)
