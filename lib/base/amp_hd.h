/*
 * amp_hd.h — AMP_HD marks a function that every backend runs on its own memory (the CUDA backend in a
 * kernel): one definition for the host and the device. Such functions are static inline in a header
 * that kernels/ (CUDA C++) includes too.
 */
#ifndef AMP_HD
#if defined(__CUDACC__)
#define AMP_HD __host__ __device__
#else
#define AMP_HD
#endif
#endif
