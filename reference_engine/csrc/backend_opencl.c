/* The OpenCL backend (backend.h): devices of any OpenCL platform (NVIDIA, AMD, Intel, mobile GPUs,
 * PoCL on a CPU), found at run time.
 *
 * No link-time dependency: the ICD loader (libOpenCL.so.1) is dlopen'ed at first use and the entry
 * points this file calls are looked up by name, declared below from the OpenCL 1.2 C API (our own
 * minimal declarations: CL/cl.h is not needed to build). Without the library, or without a device,
 * count() is 0 and last_error() says why; the CPU engine is unaffected.
 *
 * The kernels (opencl_kernels.cl, embedded as a string by setup.py) are compiled for the device
 * when it is opened; a compiler error comes back in last_error() with the compiler's log. Every
 * operation checks its views against their buffers before it queues a kernel (a kernel reading out
 * of bounds would crash the process on PoCL, or worse, silently read garbage on a GPU), then sets
 * the kernel's arguments and queues it on the device's one in-order queue; a mutex per device
 * makes that pair safe when two contexts of one model run on two threads.
 */
#define _GNU_SOURCE
#define SE_ENGINE_INTERNAL
#include "backend.h"
#include "blocks.h"
#include "kernels.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * The OpenCL API, as much of it as we call (values from the OpenCL 1.2 specification)
 */

typedef int32_t cl_int;
typedef uint32_t cl_uint;
typedef uint64_t cl_ulong;
typedef cl_ulong cl_bitfield;
typedef struct ocl_platform *cl_platform_id;
typedef struct ocl_device *cl_device_id;
typedef struct ocl_context *cl_context;
typedef struct ocl_queue *cl_command_queue;
typedef struct ocl_mem *cl_mem;
typedef struct ocl_program *cl_program;
typedef struct ocl_kernel *cl_kernel;
typedef struct ocl_event *cl_event;

#define CL_SUCCESS 0
#define CL_TRUE 1
#define CL_DEVICE_TYPE_CPU (1u << 1)
#define CL_DEVICE_TYPE_GPU (1u << 2)
#define CL_DEVICE_TYPE_ACCELERATOR (1u << 3)
#define CL_DEVICE_TYPE_ALL 0xFFFFFFFFu
#define CL_PLATFORM_NAME 0x0902
#define CL_DEVICE_TYPE 0x1000
#define CL_DEVICE_MAX_MEM_ALLOC_SIZE 0x1010
#define CL_DEVICE_GLOBAL_MEM_SIZE 0x101F
#define CL_DEVICE_NAME 0x102B
#define CL_MEM_READ_WRITE (1u << 0)
#define CL_PROGRAM_BUILD_LOG 0x1183
#define CL_KERNEL_WORK_GROUP_SIZE 0x11B0

static struct {
    cl_int (*GetPlatformIDs)(cl_uint, cl_platform_id *, cl_uint *);
    cl_int (*GetPlatformInfo)(cl_platform_id, cl_uint, size_t, void *, size_t *);
    cl_int (*GetDeviceIDs)(cl_platform_id, cl_bitfield, cl_uint, cl_device_id *, cl_uint *);
    cl_int (*GetDeviceInfo)(cl_device_id, cl_uint, size_t, void *, size_t *);
    cl_context (*CreateContext)(const intptr_t *, cl_uint, const cl_device_id *,
                                void (*)(const char *, const void *, size_t, void *), void *, cl_int *);
    cl_int (*ReleaseContext)(cl_context);
    cl_command_queue (*CreateCommandQueue)(cl_context, cl_device_id, cl_bitfield, cl_int *);
    cl_int (*ReleaseCommandQueue)(cl_command_queue);
    cl_mem (*CreateBuffer)(cl_context, cl_bitfield, size_t, void *, cl_int *);
    cl_int (*ReleaseMemObject)(cl_mem);
    cl_program (*CreateProgramWithSource)(cl_context, cl_uint, const char **, const size_t *, cl_int *);
    cl_int (*BuildProgram)(cl_program, cl_uint, const cl_device_id *, const char *,
                           void (*)(cl_program, void *), void *);
    cl_int (*GetProgramBuildInfo)(cl_program, cl_device_id, cl_uint, size_t, void *, size_t *);
    cl_int (*ReleaseProgram)(cl_program);
    cl_kernel (*CreateKernel)(cl_program, const char *, cl_int *);
    cl_int (*GetKernelWorkGroupInfo)(cl_kernel, cl_device_id, cl_uint, size_t, void *, size_t *);
    cl_int (*ReleaseKernel)(cl_kernel);
    cl_int (*SetKernelArg)(cl_kernel, cl_uint, size_t, const void *);
    cl_int (*EnqueueNDRangeKernel)(cl_command_queue, cl_kernel, cl_uint, const size_t *, const size_t *,
                                   const size_t *, cl_uint, const cl_event *, cl_event *);
    cl_int (*EnqueueWriteBuffer)(cl_command_queue, cl_mem, cl_uint, size_t, size_t, const void *, cl_uint,
                                 const cl_event *, cl_event *);
    cl_int (*EnqueueReadBuffer)(cl_command_queue, cl_mem, cl_uint, size_t, size_t, void *, cl_uint,
                                const cl_event *, cl_event *);
    cl_int (*EnqueueFillBuffer)(cl_command_queue, cl_mem, const void *, size_t, size_t, size_t, cl_uint,
                                const cl_event *, cl_event *);
    cl_int (*Finish)(cl_command_queue);
} cl;

/* The entry points by name, in the struct's order. */
static const char *const cl_names[] = {
    "clGetPlatformIDs", "clGetPlatformInfo", "clGetDeviceIDs", "clGetDeviceInfo", "clCreateContext",
    "clReleaseContext", "clCreateCommandQueue", "clReleaseCommandQueue", "clCreateBuffer",
    "clReleaseMemObject", "clCreateProgramWithSource", "clBuildProgram", "clGetProgramBuildInfo",
    "clReleaseProgram", "clCreateKernel", "clGetKernelWorkGroupInfo", "clReleaseKernel", "clSetKernelArg",
    "clEnqueueNDRangeKernel", "clEnqueueWriteBuffer", "clEnqueueReadBuffer", "clEnqueueFillBuffer",
    "clFinish",
};
_Static_assert(sizeof cl == sizeof cl_names / sizeof cl_names[0] * sizeof(void (*)(void)),
               "one name per entry point");

static const char *status_name(cl_int s) {
    static const char *const names[] = {
        [0] = "CL_SUCCESS", [1] = "CL_DEVICE_NOT_FOUND", [2] = "CL_DEVICE_NOT_AVAILABLE",
        [3] = "CL_COMPILER_NOT_AVAILABLE", [4] = "CL_MEM_OBJECT_ALLOCATION_FAILURE",
        [5] = "CL_OUT_OF_RESOURCES", [6] = "CL_OUT_OF_HOST_MEMORY", [7] = "CL_PROFILING_INFO_NOT_AVAILABLE",
        [8] = "CL_MEM_COPY_OVERLAP", [9] = "CL_IMAGE_FORMAT_MISMATCH", [10] = "CL_IMAGE_FORMAT_NOT_SUPPORTED",
        [11] = "CL_BUILD_PROGRAM_FAILURE", [12] = "CL_MAP_FAILURE", [13] = "CL_MISALIGNED_SUB_BUFFER_OFFSET",
        [14] = "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST", [15] = "CL_COMPILE_PROGRAM_FAILURE",
        [16] = "CL_LINKER_NOT_AVAILABLE", [17] = "CL_LINK_PROGRAM_FAILURE", [18] = "CL_DEVICE_PARTITION_FAILED",
        [19] = "CL_KERNEL_ARG_INFO_NOT_AVAILABLE", [30] = "CL_INVALID_VALUE", [31] = "CL_INVALID_DEVICE_TYPE",
        [32] = "CL_INVALID_PLATFORM", [33] = "CL_INVALID_DEVICE", [34] = "CL_INVALID_CONTEXT",
        [35] = "CL_INVALID_QUEUE_PROPERTIES", [36] = "CL_INVALID_COMMAND_QUEUE", [37] = "CL_INVALID_HOST_PTR",
        [38] = "CL_INVALID_MEM_OBJECT", [39] = "CL_INVALID_IMAGE_FORMAT_DESCRIPTOR",
        [40] = "CL_INVALID_IMAGE_SIZE", [41] = "CL_INVALID_SAMPLER", [42] = "CL_INVALID_BINARY",
        [43] = "CL_INVALID_BUILD_OPTIONS", [44] = "CL_INVALID_PROGRAM", [45] = "CL_INVALID_PROGRAM_EXECUTABLE",
        [46] = "CL_INVALID_KERNEL_NAME", [47] = "CL_INVALID_KERNEL_DEFINITION", [48] = "CL_INVALID_KERNEL",
        [49] = "CL_INVALID_ARG_INDEX", [50] = "CL_INVALID_ARG_VALUE", [51] = "CL_INVALID_ARG_SIZE",
        [52] = "CL_INVALID_KERNEL_ARGS", [53] = "CL_INVALID_WORK_DIMENSION", [54] = "CL_INVALID_WORK_GROUP_SIZE",
        [55] = "CL_INVALID_WORK_ITEM_SIZE", [56] = "CL_INVALID_GLOBAL_OFFSET", [57] = "CL_INVALID_EVENT_WAIT_LIST",
        [58] = "CL_INVALID_EVENT", [59] = "CL_INVALID_OPERATION", [60] = "CL_INVALID_GL_OBJECT",
        [61] = "CL_INVALID_BUFFER_SIZE", [62] = "CL_INVALID_MIP_LEVEL", [63] = "CL_INVALID_GLOBAL_WORK_SIZE",
        [64] = "CL_INVALID_PROPERTY",
    };
    if (s == -1001) return "CL_PLATFORM_NOT_FOUND_KHR (no OpenCL driver is installed)";
    if (s <= 0 && -s < (cl_int)(sizeof names / sizeof names[0]) && names[-s]) return names[-s];
    return "an unknown OpenCL status";
}

/* ---------------------------------------------------------------------------------------------
 * last_error: one message for the process, read by the caller right after a failed call
 */

static char err_msg[16384];

__attribute__((format(printf, 1, 2))) static void set_err(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_msg, sizeof err_msg, fmt, ap);
    va_end(ap);
}

/* An OpenCL call's failure, in words: SE_ERR_DEVICE (or SE_ERR_NOMEM when the device is out of
 * memory). */
static int cl_fail(const char *call, cl_int s) {
    int oom = s == -4 || s == -5 || s == -6; /* allocation failure, out of resources / host memory */
    set_err("opencl: %s failed: %s (%d)%s", call, status_name(s), (int)s,
            oom ? ": out of device memory (or host memory)" : "");
    return oom ? SE_ERR_NOMEM : SE_ERR_DEVICE;
}

static const char *last_error(void) { return err_msg; }

/* ---------------------------------------------------------------------------------------------
 * Loading the library and listing the devices, once
 */

#define MAX_DEVICES 64

typedef struct {
    cl_device_id id;
    char name[384]; /* "platform / device" */
    uint64_t mem, max_alloc;
} dev_info;

static dev_info devs[MAX_DEVICES];
static int n_devs;
static char init_err[1024]; /* why there are no devices */
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static int load_library(void) {
    const char *want = getenv("INFER_OPENCL_LIB"); /* a loader elsewhere than the linker's path */
    const char *tried[] = { want && *want ? want : "libOpenCL.so.1", want && *want ? NULL : "libOpenCL.so" };
    void *lib = NULL;
    for (int i = 0; i < 2 && !lib && tried[i]; i++) lib = dlopen(tried[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(init_err, sizeof init_err,
                 "opencl: %s not found: install an OpenCL driver (e.g. Debian's pocl-opencl-icd for the "
                 "CPU, or the GPU vendor's OpenCL ICD) and the ICD loader ocl-icd-libopencl1",
                 tried[0]);
        return 0;
    }
    for (size_t i = 0; i < sizeof cl_names / sizeof cl_names[0]; i++) {
        void *f = dlsym(lib, cl_names[i]); /* into the struct's i-th pointer (POSIX: same representation) */
        memcpy((char *)&cl + i * sizeof f, &f, sizeof f);
        if (!f) {
            snprintf(init_err, sizeof init_err, "opencl: %s has no %s (an OpenCL 1.2 loader is needed)",
                     tried[0], cl_names[i]);
            dlclose(lib);
            memset(&cl, 0, sizeof cl);
            return 0;
        }
    }
    return 1;
}

/* GPUs first (of every platform, in platform order), then accelerators, then CPUs: device 0 is the
 * GPU when a machine has both a GPU driver and PoCL. */
static void list_devices(void) {
    if (!load_library()) return;
    cl_platform_id plats[16];
    cl_uint np = 0;
    cl_int s = cl.GetPlatformIDs(16, plats, &np);
    if (s != CL_SUCCESS || np == 0) {
        snprintf(init_err, sizeof init_err, "opencl: no OpenCL platform (clGetPlatformIDs: %s): install an "
                 "OpenCL driver (e.g. Debian's pocl-opencl-icd, or the GPU vendor's OpenCL ICD)",
                 s == CL_SUCCESS ? "none" : status_name(s));
        return;
    }
    if (np > 16) np = 16;
    const cl_bitfield kinds[] = { CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_ACCELERATOR, CL_DEVICE_TYPE_CPU };
    for (int kind = 0; kind < 3; kind++)
        for (cl_uint p = 0; p < np; p++) {
            cl_device_id ids[MAX_DEVICES];
            cl_uint nd = 0;
            if (cl.GetDeviceIDs(plats[p], kinds[kind], MAX_DEVICES, ids, &nd) != CL_SUCCESS) continue;
            char pname[128] = "?";
            if (cl.GetPlatformInfo(plats[p], CL_PLATFORM_NAME, sizeof pname, pname, NULL)) strcpy(pname, "?");
            pname[sizeof pname - 1] = 0;
            for (cl_uint i = 0; i < nd && i < MAX_DEVICES && n_devs < MAX_DEVICES; i++) {
                dev_info *d = &devs[n_devs++];
                char dname[256] = "?";
                d->id = ids[i];
                if (cl.GetDeviceInfo(ids[i], CL_DEVICE_NAME, sizeof dname, dname, NULL)) strcpy(dname, "?");
                dname[sizeof dname - 1] = 0;
                snprintf(d->name, sizeof d->name, "%s / %s", pname, dname);
                cl_ulong v = 0;
                d->mem = cl.GetDeviceInfo(ids[i], CL_DEVICE_GLOBAL_MEM_SIZE, sizeof v, &v, NULL) ? 0 : v;
                v = 0;
                d->max_alloc = cl.GetDeviceInfo(ids[i], CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof v, &v, NULL) ? 0 : v;
            }
        }
    if (n_devs == 0)
        snprintf(init_err, sizeof init_err, "opencl: the OpenCL platforms here have no GPU, CPU or "
                 "accelerator device");
}

static int count(void) {
    pthread_once(&init_once, list_devices);
    if (n_devs == 0) set_err("%s", init_err);
    return n_devs;
}

static int describe(int i, char *name, size_t name_len, uint64_t *mem_bytes) {
    if (i < 0 || i >= count()) {
        set_err("opencl: no device %d (there are %d)", i, n_devs);
        return SE_ERR_INVALID;
    }
    if (name && name_len) snprintf(name, name_len, "%s", devs[i].name);
    if (mem_bytes) *mem_bytes = devs[i].mem;
    return SE_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Devices: a context, a queue, the compiled kernels
 */

static const char kernel_source[] =
#include "opencl_kernels.inc" /* opencl_kernels.cl as a string literal, made by setup.py */
    ;

#define MM_TOK 4     /* tokens per matmul work-item (the kernels' MM_TOK) */
#define ATT_CHUNK 256 /* head dimensions per attention work-item (the kernels' ATT_CHUNK): a whole head for
                       * head_dim <= 256, so its scores are computed once (4x faster for Gemma on PoCL) */
#define LOCAL 64     /* work-group size along the first dimension, at most */

enum { K_RMSNORM, K_ROPE, K_FFN_ACT, K_ADD, K_KV_STORE, K_ATTEND, K_MATMUL /* + se_type */ };
#define N_KERNELS (K_MATMUL + SE_TYPE_COUNT)
static const char *const op_kernels[K_MATMUL] = { "rmsnorm", "rope", "ffn_act", "add", "kv_store", "attend" };

static int has_matmul(int32_t t) {
    switch (t) {
    case SE_F32: case SE_F16: case SE_BF16: case SE_Q4_0: case SE_Q4_1: case SE_Q5_0: case SE_Q5_1:
    case SE_Q8_0: case SE_Q2_K: case SE_Q3_K: case SE_Q4_K: case SE_Q5_K: case SE_Q6_K: return 1;
    default: return 0;
    }
}

struct se_device {
    int index;
    cl_device_id id;
    cl_context ctx;
    cl_command_queue q;
    cl_program prog;
    cl_kernel k[N_KERNELS];
    size_t local[N_KERNELS]; /* work-group size along the first dimension */
    pthread_mutex_t lock;    /* setting a kernel's arguments and queueing it */
};

struct se_dbuf {
    cl_mem mem;
    se_device *d;
    size_t size;
};

static void close_device(se_device *d) {
    if (!d) return;
    for (int i = 0; i < N_KERNELS; i++)
        if (d->k[i]) cl.ReleaseKernel(d->k[i]);
    if (d->prog) cl.ReleaseProgram(d->prog);
    if (d->q) cl.ReleaseCommandQueue(d->q);
    if (d->ctx) cl.ReleaseContext(d->ctx);
    pthread_mutex_destroy(&d->lock);
    free(d);
}

/* The compiler's log after a failed build, into last_error(). */
static int build_failed(se_device *d, cl_int s) {
    size_t n = 0;
    char *log = NULL;
    if (cl.GetProgramBuildInfo(d->prog, d->id, CL_PROGRAM_BUILD_LOG, 0, NULL, &n) == CL_SUCCESS && n)
        log = malloc(n + 1);
    if (log && cl.GetProgramBuildInfo(d->prog, d->id, CL_PROGRAM_BUILD_LOG, n, log, NULL) != CL_SUCCESS) n = 0;
    if (log) log[n] = 0;
    set_err("opencl: the kernels failed to build for %s (clBuildProgram: %s); the compiler said:\n%s",
            devs[d->index].name, status_name(s), log && n ? log : "(no log)");
    free(log);
    return SE_ERR_DEVICE;
}

static se_device *open_device(int i) {
    if (i < 0 || i >= count()) {
        if (n_devs) set_err("opencl: no device %d (there are %d)", i, n_devs);
        return NULL;
    }
    se_device *d = calloc(1, sizeof *d);
    if (!d) {
        set_err("opencl: out of host memory");
        return NULL;
    }
    pthread_mutex_init(&d->lock, NULL);
    d->index = i;
    d->id = devs[i].id;
    cl_int s = CL_SUCCESS;
    const char *src = kernel_source;
    /* INFER_OPENCL_OPTIONS: more options for the device's compiler (appended: a later -D wins) */
    const char *extra = getenv("INFER_OPENCL_OPTIONS");
    char opts[1024];
    snprintf(opts, sizeof opts, "-DMM_TOK=%d -DATT_CHUNK=%d %s", MM_TOK, ATT_CHUNK, extra ? extra : "");
    if (!(d->ctx = cl.CreateContext(NULL, 1, &d->id, NULL, NULL, &s)) || s) {
        cl_fail("clCreateContext", s);
        goto fail;
    }
    if (!(d->q = cl.CreateCommandQueue(d->ctx, d->id, 0, &s)) || s) {
        cl_fail("clCreateCommandQueue", s);
        goto fail;
    }
    if (!(d->prog = cl.CreateProgramWithSource(d->ctx, 1, &src, NULL, &s)) || s) {
        cl_fail("clCreateProgramWithSource", s);
        goto fail;
    }
    if ((s = cl.BuildProgram(d->prog, 1, &d->id, opts, NULL, NULL)) != CL_SUCCESS) {
        build_failed(d, s);
        goto fail;
    }
    for (int k = 0; k < N_KERNELS; k++) {
        char name[32];
        if (k < K_MATMUL)
            snprintf(name, sizeof name, "%s", op_kernels[k]);
        else if (has_matmul(k - K_MATMUL))
            snprintf(name, sizeof name, "matmul_%s", se_traits(k - K_MATMUL)->name);
        else
            continue;
        if (!(d->k[k] = cl.CreateKernel(d->prog, name, &s)) || s) {
            set_err("opencl: clCreateKernel(%s) failed: %s (%d)", name, status_name(s), (int)s);
            goto fail;
        }
        size_t wg = 0;
        if ((s = cl.GetKernelWorkGroupInfo(d->k[k], d->id, CL_KERNEL_WORK_GROUP_SIZE, sizeof wg, &wg, NULL))) {
            cl_fail("clGetKernelWorkGroupInfo", s);
            goto fail;
        }
        d->local[k] = wg < 1 ? 1 : wg < LOCAL ? wg : LOCAL;
    }
    return d;
fail:
    close_device(d);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Memory
 */

static int supports_type(int32_t t) { return has_matmul(t); }

static se_dbuf *alloc_buf(se_device *d, size_t bytes) {
    const dev_info *di = &devs[d->index];
    if (di->max_alloc && bytes > di->max_alloc) {
        set_err("opencl: out of device memory: a buffer of %zu bytes is more than %s allows in one "
                "allocation (%llu bytes)", bytes, di->name, (unsigned long long)di->max_alloc);
        return NULL;
    }
    se_dbuf *b = calloc(1, sizeof *b);
    if (!b) {
        set_err("opencl: out of host memory");
        return NULL;
    }
    b->d = d;
    b->size = bytes;
    size_t n = bytes ? bytes : 1; /* OpenCL has no empty buffers */
    cl_int s = CL_SUCCESS;
    const char *call = "clCreateBuffer";
    b->mem = cl.CreateBuffer(d->ctx, CL_MEM_READ_WRITE, n, NULL, &s);
    if (b->mem && !s) {
        /* Drivers may reserve the memory only at first use: zeroing it now makes "out of memory" an
         * error of this call, with the bytes asked for, rather than of some later kernel. */
        const unsigned char zero = 0;
        call = "clEnqueueFillBuffer";
        s = cl.EnqueueFillBuffer(d->q, b->mem, &zero, 1, 0, n, 0, NULL, NULL);
        if (!s) call = "clFinish", s = cl.Finish(d->q);
    }
    if (!b->mem || s) {
        char what[96];
        snprintf(what, sizeof what, "%s (a buffer of %zu bytes)", call, bytes);
        cl_fail(what, s ? s : -4);
        if (b->mem) cl.ReleaseMemObject(b->mem);
        free(b);
        return NULL;
    }
    return b;
}

static void release_buf(se_dbuf *b) {
    if (!b) return;
    cl.ReleaseMemObject(b->mem);
    free(b);
}

/* A view holds `bytes` from its offset (and floats start on a float boundary when `floats`). */
static int check_view(se_device *d, se_dview v, size_t bytes, int floats, const char *op, const char *what) {
    if (!v.buf) {
        set_err("opencl %s: %s is not a device buffer", op, what);
        return SE_ERR_INVALID;
    }
    if (d && v.buf->d != d) {
        set_err("opencl %s: %s is a buffer of another device", op, what);
        return SE_ERR_INVALID;
    }
    if (floats && v.off % sizeof(float)) {
        set_err("opencl %s: %s starts at byte %zu, not on a float", op, what, v.off);
        return SE_ERR_INVALID;
    }
    if (v.off > v.buf->size || bytes > v.buf->size - v.off) {
        set_err("opencl %s: %s needs %zu bytes at offset %zu of a buffer of %zu bytes", op, what, bytes, v.off,
                v.buf->size);
        return SE_ERR_INVALID;
    }
    return SE_OK;
}

static int write_buf(se_dview dst, const void *src, size_t n) {
    int r = check_view(NULL, dst, n, 0, "write", "the destination");
    if (r || !n) return r;
    cl_int s = cl.EnqueueWriteBuffer(dst.buf->d->q, dst.buf->mem, CL_TRUE, dst.off, n, src, 0, NULL, NULL);
    return s ? cl_fail("clEnqueueWriteBuffer", s) : SE_OK;
}

static int read_buf(se_dview src, void *dst, size_t n) {
    int r = check_view(NULL, src, n, 0, "read", "the source");
    if (r || !n) return r;
    cl_int s = cl.EnqueueReadBuffer(src.buf->d->q, src.buf->mem, CL_TRUE, src.off, n, dst, 0, NULL, NULL);
    return s ? cl_fail("clEnqueueReadBuffer (or a kernel before it)", s) : SE_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Operations: check the views, set the arguments, queue the kernel
 */

typedef struct {
    size_t size;
    const void *ptr;
} karg;
#define ARG(v) ((karg){ sizeof(v), &(v) })

/* Queues kernel k over g0 x g1 work-items (g0 rounded up to the work-group size; the kernels
 * ignore the extra ones). */
static int launch(se_device *d, int k, const karg *args, int nargs, size_t g0, size_t g1) {
    if (g0 == 0 || g1 == 0) return SE_OK;
    size_t local[2] = { d->local[k], 1 }, global[2] = { (g0 + local[0] - 1) / local[0] * local[0], g1 };
    const char *name = k < K_MATMUL ? op_kernels[k] : "matmul";
    pthread_mutex_lock(&d->lock);
    cl_int s = CL_SUCCESS;
    for (int i = 0; i < nargs && !s; i++) s = cl.SetKernelArg(d->k[k], (cl_uint)i, args[i].size, args[i].ptr);
    if (!s) s = cl.EnqueueNDRangeKernel(d->q, d->k[k], 2, NULL, global, local, 0, NULL, NULL);
    pthread_mutex_unlock(&d->lock);
    if (!s) return SE_OK;
    char call[64];
    snprintf(call, sizeof call, "queueing the %s kernel", name);
    return cl_fail(call, s);
}

#define F4 sizeof(float)
#define CHECK(expr)                   \
    do {                              \
        int r_ = (expr);              \
        if (r_) return r_;            \
    } while (0)

static int matmul(se_device *d, int32_t wtype, se_dview W, size_t row_size, int64_t k, int64_t n_rows,
                  se_dview x, int32_t n_tok, se_dview y, int64_t ldy) {
    if (!has_matmul(wtype)) {
        const se_type_traits *t = se_traits(wtype);
        set_err("opencl matmul: no kernel for tensor type %s", t ? t->name : "(unknown)");
        return SE_ERR_INVALID;
    }
    if (k < 1 || k > INT32_MAX || n_rows < 0 || n_rows > INT32_MAX || n_tok < 0 || k % se_traits(wtype)->blck ||
        row_size != se_row_size(wtype, k) || (n_tok > 1 && ldy < n_rows)) {
        set_err("opencl matmul: bad shape (type %s, k %lld, row_size %zu, rows %lld, tokens %d, ldy %lld)",
                se_traits(wtype)->name, (long long)k, row_size, (long long)n_rows, n_tok, (long long)ldy);
        return SE_ERR_INVALID;
    }
    if (n_rows == 0 || n_tok == 0) return SE_OK;
    CHECK(check_view(d, W, (size_t)n_rows * row_size, 0, "matmul", "W"));
    CHECK(check_view(d, x, (size_t)n_tok * (size_t)k * F4, 1, "matmul", "x"));
    CHECK(check_view(d, y, ((size_t)(n_tok - 1) * (size_t)ldy + (size_t)n_rows) * F4, 1, "matmul", "y"));
    cl_ulong woff = W.off, rs = row_size, xoff = x.off / F4, yoff = y.off / F4;
    cl_int kk = (cl_int)k, nr = (cl_int)n_rows, nt = n_tok;
    int64_t ld = ldy;
    karg a[] = { ARG(W.buf->mem), ARG(woff), ARG(rs), ARG(kk), ARG(nr), ARG(x.buf->mem), ARG(xoff), ARG(nt),
                 ARG(y.buf->mem), ARG(yoff), ARG(ld) };
    return launch(d, K_MATMUL + wtype, a, 11, (size_t)n_rows, (size_t)(n_tok + MM_TOK - 1) / MM_TOK);
}

static int rmsnorm(se_device *d, se_dview y, se_dview x, se_dview w, int64_t n, int64_t rows, float eps) {
    if (n < 1 || rows < 0 || rows > INT32_MAX) {
        set_err("opencl rmsnorm: bad shape (n %lld, rows %lld)", (long long)n, (long long)rows);
        return SE_ERR_INVALID;
    }
    size_t bytes = (size_t)rows * (size_t)n * F4;
    CHECK(check_view(d, y, bytes, 1, "rmsnorm", "y"));
    CHECK(check_view(d, x, bytes, 1, "rmsnorm", "x"));
    CHECK(check_view(d, w, (size_t)n * F4, 1, "rmsnorm", "w"));
    cl_ulong yoff = y.off / F4, xoff = x.off / F4, woff = w.off / F4;
    int64_t nn = n;
    cl_int nr = (cl_int)rows;
    karg a[] = { ARG(y.buf->mem), ARG(yoff), ARG(x.buf->mem), ARG(xoff), ARG(w.buf->mem), ARG(woff), ARG(nn),
                 ARG(nr), ARG(eps) };
    return launch(d, K_RMSNORM, a, 9, (size_t)rows, 1);
}

static int rope(se_device *d, se_dview x, int32_t n_tok, int32_t n_head, int32_t head_dim, int32_t n_rot,
                int32_t mode, int32_t pos0, float base, float freq_scale) {
    if (n_tok < 0 || n_head < 1 || head_dim < 2 || n_rot < 2 || n_rot > head_dim || n_rot % 2 || pos0 < 0 ||
        (mode != SE_ROPE_NORM && mode != SE_ROPE_NEOX) || (int64_t)n_tok * n_head > INT32_MAX) {
        set_err("opencl rope: bad arguments (tokens %d, heads %d, head_dim %d, n_rot %d, mode %d, pos0 %d)", n_tok,
                n_head, head_dim, n_rot, mode, pos0);
        return SE_ERR_INVALID;
    }
    CHECK(check_view(d, x, (size_t)n_tok * (size_t)n_head * (size_t)head_dim * F4, 1, "rope", "x"));
    /* the angle's step as blocks.c's rope_table computes it, on the host: the same powf */
    float theta_scale = powf(base, -2.0f / (float)n_rot);
    cl_ulong xoff = x.off / F4;
    cl_int rows = n_tok * n_head, neox = mode == SE_ROPE_NEOX;
    karg a[] = { ARG(x.buf->mem), ARG(xoff), ARG(rows), ARG(n_head), ARG(head_dim), ARG(n_rot), ARG(neox),
                 ARG(pos0), ARG(theta_scale), ARG(freq_scale) };
    return launch(d, K_ROPE, a, 10, (size_t)rows, (size_t)n_rot / 2);
}

/* The KV cache of one layer (keys or values): [n_head_kv][n_ctx][head_dim] f32, a row per position
 * (kv_store writes rows, attend reads them). */
static size_t kv_bytes(int32_t n_ctx, int32_t n_head_kv, int32_t head_dim) {
    return (size_t)n_ctx * (size_t)n_head_kv * (size_t)head_dim * F4;
}

static int attention(se_device *d, se_dview q, se_dview k_new, se_dview v_new, se_dview kc, se_dview vc,
                     int32_t n_ctx, int32_t n_tok, int32_t pos0, int32_t n_head, int32_t n_head_kv,
                     int32_t head_dim, int32_t window, float scale, se_dview out) {
    if (n_tok < 0 || n_head < 1 || n_head_kv < 1 || n_head % n_head_kv || head_dim < 1 || pos0 < 0 ||
        window < 0 || (int64_t)pos0 + n_tok > n_ctx) {
        set_err("opencl attention: bad arguments (n_ctx %d, tokens %d, pos0 %d, heads %d / %d kv, head_dim %d, "
                "window %d)", n_ctx, n_tok, pos0, n_head, n_head_kv, head_dim, window);
        return SE_ERR_INVALID;
    }
    if (n_tok == 0) return SE_OK;
    size_t qb = (size_t)n_tok * (size_t)n_head * (size_t)head_dim * F4;
    size_t kvb = (size_t)n_tok * (size_t)n_head_kv * (size_t)head_dim * F4;
    CHECK(check_view(d, q, qb, 1, "attention", "q"));
    CHECK(check_view(d, k_new, kvb, 1, "attention", "k_new"));
    CHECK(check_view(d, v_new, kvb, 1, "attention", "v_new"));
    CHECK(check_view(d, kc, kv_bytes(n_ctx, n_head_kv, head_dim), 1, "attention", "the key cache"));
    CHECK(check_view(d, vc, kv_bytes(n_ctx, n_head_kv, head_dim), 1, "attention", "the value cache"));
    CHECK(check_view(d, out, qb, 1, "attention", "out"));
    cl_ulong kco = kc.off / F4, vco = vc.off / F4, kno = k_new.off / F4, vno = v_new.off / F4;
    cl_ulong qo = q.off / F4, oo = out.off / F4;
    cl_int n_kv = n_head_kv * head_dim;
    karg st[] = { ARG(kc.buf->mem), ARG(kco), ARG(vc.buf->mem), ARG(vco), ARG(k_new.buf->mem), ARG(kno),
                  ARG(v_new.buf->mem), ARG(vno), ARG(n_ctx), ARG(pos0), ARG(n_kv), ARG(head_dim) };
    CHECK(launch(d, K_KV_STORE, st, 12, (size_t)n_kv, (size_t)n_tok));
    karg at[] = { ARG(q.buf->mem), ARG(qo), ARG(kc.buf->mem), ARG(kco), ARG(vc.buf->mem), ARG(vco),
                  ARG(out.buf->mem), ARG(oo), ARG(n_ctx), ARG(pos0), ARG(n_head), ARG(n_head_kv),
                  ARG(head_dim), ARG(window), ARG(scale) };
    size_t n_chunk = ((size_t)head_dim + ATT_CHUNK - 1) / ATT_CHUNK;
    return launch(d, K_ATTEND, at, 15, (size_t)n_head * n_chunk, (size_t)n_tok);
}

static int ffn_act(se_device *d, se_dview g, se_dview u, int64_t n, int32_t act) {
    if (n < 0 || (act != SE_FFN_SILU && act != SE_FFN_GELU_TANH)) {
        set_err("opencl ffn_act: bad arguments (n %lld, act %d)", (long long)n, act);
        return SE_ERR_INVALID;
    }
    CHECK(check_view(d, g, (size_t)n * F4, 1, "ffn_act", "g"));
    CHECK(check_view(d, u, (size_t)n * F4, 1, "ffn_act", "u"));
    cl_ulong go = g.off / F4, uo = u.off / F4;
    int64_t nn = n;
    cl_int a_ = act == SE_FFN_SILU ? 0 : 1;
    karg a[] = { ARG(g.buf->mem), ARG(go), ARG(u.buf->mem), ARG(uo), ARG(nn), ARG(a_) };
    return launch(d, K_FFN_ACT, a, 6, (size_t)n, 1);
}

static int add(se_device *d, se_dview x, se_dview y, int64_t n) {
    if (n < 0) {
        set_err("opencl add: bad length %lld", (long long)n);
        return SE_ERR_INVALID;
    }
    CHECK(check_view(d, x, (size_t)n * F4, 1, "add", "x"));
    CHECK(check_view(d, y, (size_t)n * F4, 1, "add", "y"));
    cl_ulong xo = x.off / F4, yo = y.off / F4;
    int64_t nn = n;
    karg a[] = { ARG(x.buf->mem), ARG(xo), ARG(y.buf->mem), ARG(yo), ARG(nn) };
    return launch(d, K_ADD, a, 5, (size_t)n, 1);
}

static int finish(se_device *d) {
    cl_int s = cl.Finish(d->q);
    return s ? cl_fail("clFinish (a kernel queued before it failed)", s) : SE_OK;
}

const se_backend se_backend_opencl = {
    .name = "opencl",
    .count = count,
    .describe = describe,
    .open = open_device,
    .close = close_device,
    .last_error = last_error,
    .supports_type = supports_type,
    .alloc = alloc_buf,
    .release = release_buf,
    .write = write_buf,
    .read = read_buf,
    .matmul = matmul,
    .rmsnorm = rmsnorm,
    .rope = rope,
    .attention = attention,
    .kv_bytes = kv_bytes,
    .ffn_act = ffn_act,
    .add = add,
    .finish = finish,
};

/* Test hook (tests/test_opencl_kernels.py): the table itself, so that the kernel tests call each
 * operation through ctypes exactly as device_forward.c calls it. Not part of the engine's API. */
SE_API const se_backend *se_opencl_backend(void) { return &se_backend_opencl; }
