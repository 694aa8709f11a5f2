#!/usr/bin/env python3
"""LABELLED PATCH (test harness only): vLLM PR #51599's approach to #51571, applied to a copy of
vLLM 0.32.0's `v1/worker/gpu_model_runner.py` for the fixed twin of the live race run
(scripts/gpu_run.sh hybrid-async-v1-fix51599; docs/live-gpu.md).

    python scripts/patches/vllm_pr51599_approach.py SITE/vllm/v1/worker/gpu_model_runner.py

Under async scheduling in Mamba "align" mode the fused postprocess copies the accepted counts
into the runner's own host buffer (`self.num_accepted_tokens.cpu`), which InputBatch row moves
(add_request, condense, swap_states) never touch, and `_prepare_inputs` gathers the previous
step's counts from that snapshot through `prev_positions`, instead of from
`input_batch.num_accepted_tokens_cpu`. Two replacements, each must match exactly once; the
patched lines carry "pdtrace: PR #51599 approach". Not the PR's code: its idea, written against
0.32.0 (the PR's review also reworks the no-previous-mapping branch, left as it is here).
"""

import sys

EDITS = [
    ("""                num_accepted_tokens_cpu_tensor=(
                    self.input_batch.num_accepted_tokens_cpu_tensor
                ),""",
     """                num_accepted_tokens_cpu_tensor=(
                    self.num_accepted_tokens.cpu  # pdtrace: PR #51599 approach (snapshot)
                    if self.use_async_scheduling
                    else self.input_batch.num_accepted_tokens_cpu_tensor
                ),"""),
    ("""                self.num_accepted_tokens.np[:num_reqs] = (
                    self.input_batch.num_accepted_tokens_cpu[
                        np.where(new_mask, 0, prev_idx)
                    ]
                )""",
     """                self.num_accepted_tokens.np[:num_reqs] = (
                    self.num_accepted_tokens.np[  # pdtrace: PR #51599 approach (snapshot)
                        np.where(new_mask, 0, prev_idx)
                    ]
                )"""),
]


def main(path: str) -> int:
    s = open(path).read()
    for old, new in EDITS:
        n = s.count(old)
        if n != 1:
            print(f"vllm_pr51599_approach: {path}: expected the original text once, found it {n} times", file=sys.stderr)
            return 2
        s = s.replace(old, new)
    open(path, "w").write(s)
    print(f"vllm_pr51599_approach: patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
