"""BitDP: channel-wise 1/2-bit gradients as a DDP communication hook, for any optimizer
(BitDP: Ultra-Low Bit Communication for Efficient Data Parallelism in LLM Training).

``config.py`` its config section, ``quantized_params.py`` which gradients are quantized,
``hook.py`` the hook and its per-rank state, ``algorithm.py`` its registry entry.
"""

from lowbit_strategy.algorithms.bitdp.algorithm import ALGORITHM, BitDPSync
from lowbit_strategy.algorithms.bitdp.config import BitDPConfig
from lowbit_strategy.algorithms.bitdp.hook import BitDPState, bitdp_hook
from lowbit_strategy.algorithms.bitdp.quantized_params import ParamInfo, classify

__all__ = ["ALGORITHM", "BitDPConfig", "BitDPState", "BitDPSync", "ParamInfo", "bitdp_hook", "classify"]
