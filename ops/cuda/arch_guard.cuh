// HIERPAR_PRE_SM80_CODE is defined while nvcc compiles device code for an architecture older than sm_80 (sm_75,
// the oldest torch supports). Device helpers that use sm_80 instructions (cp.async, mma.sync m16n8k16, TF32)
// compile to a trap there; the host routes around every kernel that calls them (DeviceCaps, device_caps.h), so
// the trap is never reached. Private to hierpar_ops.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define HIERPAR_PRE_SM80_CODE 1
#endif
