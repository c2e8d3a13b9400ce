"""How a GGUF's quantized linear layers are held (`--weights`): the choices, without torch, so
the CLI can name them; what each does is models/loader.py's load_model."""

from __future__ import annotations

# auto: as stored, plus a bf16 copy for steps of many rows where this CPU multiplies that faster
# (quant_linear.dense_from_rows); native: as stored only; dequantized: rounded to --dtype at load.
WEIGHTS = ("auto", "native", "dequantized")
