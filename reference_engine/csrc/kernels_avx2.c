/* avx2 dot products (filled in below). */
#define SE_KERNELS_INTERNAL
#include "kernels.h"

const se_isa_kernels se_kernels_avx2[SE_TYPE_COUNT] = {0};
