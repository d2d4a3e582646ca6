// The generic build of the fused CPU attention kernel (attention_cpu_kernel.h) and of the linear kernel
// (linear_cpu_kernel.h): 8-lane vectors compiled
// for whatever instruction set the compiler flags give (baseline x86-64: SSE2, two xmm registers per
// vector). attention_cpu.cpp calls it on CPUs without AVX2 + FMA, and it is the only build off x86.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_cpu_internal.h"
#include "linear_cpu.h"

// The 8-lane vectors are internal to this file, so GCC's note that passing them changes the ABI without
// AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#define RETMASK_VL 8
#define RETMASK_ISA generic
#include "attention_cpu_kernel.h"
#include "attention_bwd_cpu_kernel.h"
#include "linear_cpu_kernel.h"
