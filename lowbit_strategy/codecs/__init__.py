"""Codecs: tensor ⇄ payload. Pure, deterministic, device-agnostic functions.

Nothing here talks to a process group (that is :mod:`lowbit_strategy.collectives`), and
importing it touches no CUDA and compiles nothing, so it is safe before a fork.
"""

from lowbit_strategy.codecs.bits import LANE_BITS, Lane, lane, narrowest_lane, pack, unpack
from lowbit_strategy.codecs.channel import channel_decode, channel_encode, channel_encode_many
from lowbit_strategy.codecs.lp import levels_for_bits, lp_norm_mean, lp_quantize, lp_quantize_levels, lp_quantize_many
from lowbit_strategy.codecs.signs import (
    sign_alternating,
    sign_bits,
    sign_bits_packed,
    signs_from_bits,
    tie_is_positive,
)
from lowbit_strategy.codecs.votes import majority_bits

__all__ = [
    "LANE_BITS",
    "Lane",
    "lane",
    "narrowest_lane",
    "pack",
    "unpack",
    "sign_bits",
    "sign_bits_packed",
    "sign_alternating",
    "signs_from_bits",
    "tie_is_positive",
    "majority_bits",
    "levels_for_bits",
    "lp_norm_mean",
    "lp_quantize",
    "lp_quantize_levels",
    "lp_quantize_many",
    "channel_encode",
    "channel_encode_many",
    "channel_decode",
]

# Error-compensated 1-bit codes with one scale per vector or per block (1-bit LAMB / 1-bit Adam); see scaled_signs.py.
from lowbit_strategy.codecs.scaled_signs import (  # noqa: E402
    scaled_sign_compress,
    scaled_sign_decode,
    scaled_sign_mean,
)

__all__ += ["scaled_sign_compress", "scaled_sign_decode", "scaled_sign_mean"]

# TurboQuant: randomized Hadamard rotation + Lloyd–Max levels (hadamard.py, lloyd_max.py, turboquant.py).
from lowbit_strategy.codecs.hadamard import hadamard_rotate, hadamard_signs, hadamard_unrotate  # noqa: E402
from lowbit_strategy.codecs.lloyd_max import lloyd_max_codebook, lloyd_max_mse  # noqa: E402
from lowbit_strategy.codecs.turboquant import TurboQuantCodec, TurboQuantPayload  # noqa: E402

__all__ += [
    "hadamard_rotate",
    "hadamard_unrotate",
    "hadamard_signs",
    "lloyd_max_codebook",
    "lloyd_max_mse",
    "TurboQuantCodec",
    "TurboQuantPayload",
]

# Opt-in compiled chains of the hot codecs (LowBitConfig.compile_codecs); see compiled.py.
from lowbit_strategy.codecs.compiled import compiled_enabled, use_compiled  # noqa: E402

__all__ += ["compiled_enabled", "use_compiled"]
