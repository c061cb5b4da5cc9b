"""KVarN's numerics constants, shared by the pure-torch reference (`kvarn.formats.kvarn_tiles`)
and the Triton kernels (`kvarn.formats.kvarn_triton`), so that neither imports the other's
module for them."""

STD_MIN, STD_MAX = 1e-3, 1e3  # clamp on a measured std before taking its log
LOG_MIN, LOG_MAX = -0.3, 10.0  # clamp on the accumulated log-scales a, b
RATIO_FLOOR = 1e-8  # denominator floor of the imbalance ratios
STEP_MIN = 1e-10  # floor of the RTN step (a constant row quantizes to code 0)
