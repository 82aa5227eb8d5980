/* Run-time CPU feature check shared by nybble's C kernels: each compiles an AVX2+FMA copy of
 * its hot loop with a function target attribute (so the module still loads on any x86-64 or
 * other CPU) and calls it only when this says the CPU has both. */
#ifndef NYB_CPU_FEATURES_H
#define NYB_CPU_FEATURES_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NYB_X86_AVX2 1
static inline int nyb_cpu_has_avx2_fma(void) {
    static int have = -1;
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return have;
}
#else
static inline int nyb_cpu_has_avx2_fma(void) { return 0; }
#endif

#endif
