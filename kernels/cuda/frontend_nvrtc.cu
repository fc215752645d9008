/*
 * frontend_nvrtc.cu — the NVRTC entry points the cuDNN frontend's headers reference, answered "unavailable".
 *
 * cudnn_frontend.h (attention_cudnn.cpp) compiles, inline, experimental engines of its own (an sm_100 RMSNorm+SiLU
 * kernel) that build CUDA source at run time through NVRTC. We never reach them: the fused attention asks cuDNN for
 * its SDPA engines only. But the module is linked with --no-undefined, and linking libnvrtc itself (110 MB, CUDA 13)
 * would make every GPU machine need it and would not fit the GPU bundle. So the seven functions those engines call
 * are defined here, local to the module (module.map exports one symbol), each returning NVRTC_ERROR_INTERNAL_ERROR:
 * should a future frontend path reach one, that path fails with the frontend's own error message, recorded by the
 * backend, instead of the module failing to load. cuDNN's own runtime-compiled engines load NVRTC themselves (dlopen)
 * and never see these.
 */
#ifdef AMP_HAVE_CUDNN_FRONTEND

#include <nvrtc.h> /* nvrtcResult, nvrtcProgram: the declarations these definitions must match */

extern "C" {

nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name, int numHeaders,
                               const char *const *headers, const char *const *includeNames)
{
    (void)src, (void)name, (void)numHeaders, (void)headers, (void)includeNames;
    if (prog)
        *prog = nullptr;
    return NVRTC_ERROR_INTERNAL_ERROR;
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog)
{
    (void)prog;
    return NVRTC_ERROR_INTERNAL_ERROR;
}

nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int numOptions, const char *const *options)
{
    (void)prog, (void)numOptions, (void)options;
    return NVRTC_ERROR_INTERNAL_ERROR;
}

nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *cubinSizeRet)
{
    (void)prog;
    if (cubinSizeRet)
        *cubinSizeRet = 0;
    return NVRTC_ERROR_INTERNAL_ERROR;
}

nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin)
{
    (void)prog, (void)cubin;
    return NVRTC_ERROR_INTERNAL_ERROR;
}

nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t *logSizeRet)
{
    (void)prog;
    if (logSizeRet)
        *logSizeRet = 0;
    return NVRTC_ERROR_INTERNAL_ERROR;
}

nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char *log)
{
    (void)prog;
    if (log)
        *log = '\0';
    return NVRTC_ERROR_INTERNAL_ERROR;
}

} /* extern "C" */

#endif
