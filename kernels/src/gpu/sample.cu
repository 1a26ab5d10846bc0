// sample.cu: see kernels/src/gpu/mod.rs.
#include "compat.cuh"
