"""Prompts whose greedy answer from the bundled model tests a kernel or a path end to end.

"What is the capital of France?" alone is a poor probe: the model's first token leads ("The" over
"L", whose answer never says Paris) by 0.08 in float32, less than one step of a bf16 logit there
(0.125), so the bf16 arithmetic of a correct kernel may tie or flip it (it does on AVX512-BF16
without AMX). With "Answer in one sentence." the chosen token leads by 0.86 or more at every step.
"""

PARIS_PROMPT = "What is the capital of France? Answer in one sentence."  # greedy: "... Paris."
