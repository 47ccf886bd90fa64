"""Set the served constants of the installed msa_kernels (/tmp/site) to a candidate's, for a peers run.

    python3 .devcalls/variant.py decode             # sparse_attn.WARPS 4, index_scores.LANE_ELEMS 16
    python3 .devcalls/variant.py prefill SWEEP_LOG  # the sweep's best (warpgroups, stages, union bound, leftovers)
"""

import math
import re
import sys
from collections import defaultdict
from pathlib import Path

SITE = Path("/tmp/site/msa_kernels/cute")


def edit(name, old, new):
    path = SITE / name
    text = path.read_text()
    assert text.count(old) == 1, (name, old)
    path.write_text(text.replace(old, new))
    print(f"{name}: {old.strip()!r} -> {new.strip()!r}")


def best_prefill(log):
    served = (1, 1, 44, "per_token")
    times = defaultdict(dict)  # config -> problem -> ms
    problem = None
    for line in Path(log).read_text().splitlines():
        m = re.match(r"^(\d+) (\S+): union", line)
        if m:
            problem = m.group(0)
            continue
        m = re.match(r"^\s+warpgroups (\d) stages (\d) max_union (\d+) leftovers (\w+): ([\d.]+) ms cos ([\d.]+)", line)
        if m and problem:
            w, s, b, left, t, cos = m.groups()
            if float(cos) >= 0.999:
                times[(int(w), int(s), int(b), left)][problem] = float(t)
    problems = set(times[served])
    scores = {
        config: math.exp(sum(math.log(t[p] / times[served][p]) for p in problems) / len(problems))
        for config, t in times.items()
        if problems and set(t) >= problems
    }
    for config, score in sorted(scores.items(), key=lambda kv: kv[1])[:8]:
        print(f"  {config}: {score:.3f} x served (geomean over {len(problems)} problems)")
    return min(scores, key=scores.get)


if __name__ == "__main__":
    if sys.argv[1] == "decode":
        edit("sparse_attn.py", "\nWARPS = 1  #", "\nWARPS = 4  #")
        edit("index_scores.py", "\nLANE_ELEMS = 8  #", "\nLANE_ELEMS = 16  #")
    else:
        w, s, b, left = best_prefill(sys.argv[2])
        print(f"prefill variant: warpgroups {w} stages {s} max_union {b} leftovers {left}")
        edit("sparse_attn_prefill.py", "\nMAX_UNION = 0.7  #", f"\nMAX_UNION = {b / (4 * w * 16)!r}  #")
        edit("sparse_attn_prefill.py", "    stages: int = 1,\n", f"    stages: int = {s},\n")
        edit("sparse_attn_prefill.py", "    warpgroups: int = 1,\n", f"    warpgroups: int = {w},\n")
        edit(
            "sparse_attn_prefill.py",
            '    leftovers: Literal["per_token", "by_block"] = "per_token",\n',
            f'    leftovers: Literal["per_token", "by_block"] = "{left}",\n',
        )
