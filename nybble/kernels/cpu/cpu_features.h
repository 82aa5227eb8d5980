/* Run-time CPU feature check shared by nybble's C kernels: each compiles an AVX2+FMA(+F16C)
 * copy of its hot loop with a function target attribute (so the module still loads on any
 * x86-64 or other CPU) and calls it only when this says the CPU has them (every AVX2 CPU
 * made has F16C, the float16 conversions). */
#ifndef NYB_CPU_FEATURES_H
#define NYB_CPU_FEATURES_H

#include <stdint.h>
#include <string.h>

/* IEEE float16 bits -> float (exact: every float16 value is a float). */
static inline float nyb_half_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0) {
        if (m == 0) u = sign;
        else {  /* subnormal: normalise */
            int sh = 0;
            uint32_t mm = m;
            while (!(mm & 0x400)) { mm <<= 1; sh++; }
            u = sign | ((uint32_t)(113 - sh) << 23) | ((mm & 0x3ff) << 13);
        }
    } else if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else u = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NYB_X86_AVX2 1
static inline int nyb_cpu_has_avx2_fma(void) {
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && __builtin_cpu_supports("f16c");
    }
    return have;
}
#else
static inline int nyb_cpu_has_avx2_fma(void) { return 0; }
#endif

#endif
