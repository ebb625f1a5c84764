/* A stand-in for libcuda.so.1 with the driver functions tsukimi/device/cuda.py calls, over host
 * memory, so CI exercises that module's ctypes layer (signatures, structs passed by value,
 * contexts, streams, IPC, pinning) without a GPU. Not CUDA: no kernels, no real streams.
 *
 * "Device" memory comes from fakeMalloc (a shared-memory file, mapped), so another process can
 * open its IPC handle (the file's name) as CUDA IPC allows. Errors mirror the driver's codes for
 * the cases the backend meets: no current context, a pointer that is not device memory, a handle
 * opened by the process that exported it, host memory registered twice.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef uint64_t CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

#define OK 0
#define ERR_INVALID_VALUE 1
#define ERR_NOT_INITIALIZED 3
#define ERR_INVALID_CONTEXT 201
#define ERR_ALREADY_REGISTERED 712
#define ERR_NOT_REGISTERED 713
#define MAX_ALLOCS 256

typedef struct { CUdeviceptr base; size_t size; int used; int opened; char name[48]; } Alloc;
typedef struct { uintptr_t base; size_t size; int used; } Pinned;

static Alloc allocs[MAX_ALLOCS];
static Pinned pinned[MAX_ALLOCS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static __thread void *current;
static int counter;
long fakeCopies;        /* every cuMemcpyAsync, for the tests */
long fakeContextSwitches;

static Alloc *find(CUdeviceptr p) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].used && p >= allocs[i].base && p < allocs[i].base + allocs[i].size) return &allocs[i];
    return NULL;
}

static Alloc *slot(void) {
    for (int i = 0; i < MAX_ALLOCS; i++) if (!allocs[i].used) return &allocs[i];
    return NULL;
}

CUdeviceptr fakeMalloc(size_t size) {
    pthread_mutex_lock(&lock);
    Alloc *a = slot();
    if (!a) { pthread_mutex_unlock(&lock); return 0; }
    snprintf(a->name, sizeof a->name, "/fakecuda-%d-%d", (int)getpid(), counter++);
    int fd = shm_open(a->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { pthread_mutex_unlock(&lock); return 0; }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) { shm_unlink(a->name); pthread_mutex_unlock(&lock); return 0; }
    a->base = (CUdeviceptr)(uintptr_t)m; a->size = size; a->used = 1; a->opened = 0;
    pthread_mutex_unlock(&lock);
    return a->base;
}

void fakeFree(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    Alloc *a = find(p);
    if (a && a->base == p) { munmap((void *)(uintptr_t)a->base, a->size); shm_unlink(a->name); a->used = 0; }
    pthread_mutex_unlock(&lock);
}

CUresult cuInit(unsigned int flags) { (void)flags; initialized = 1; return OK; }
CUresult cuDeviceGetCount(int *count) { if (!initialized) return ERR_NOT_INITIALIZED; *count = 1; return OK; }
CUresult cuDeviceGet(int *device, int ordinal) { if (ordinal != 0) return ERR_INVALID_VALUE; *device = ordinal; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = (void *)(uintptr_t)(0x1000 + device); return OK; }
CUresult cuCtxSetCurrent(void *ctx) { if (ctx != current) fakeContextSwitches++; current = ctx; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }

CUresult cuStreamCreate(void **stream, unsigned int flags) {
    if (!current) return ERR_INVALID_CONTEXT;
    static int streams;
    *stream = (void *)(uintptr_t)(0x5000 + ((flags & 1) << 12) + __sync_fetch_and_add(&streams, 1));
    return OK;
}
CUresult cuStreamSynchronize(void *stream) { return stream && current ? OK : ERR_INVALID_CONTEXT; }

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    if (!current || !stream) return ERR_INVALID_CONTEXT;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    __sync_fetch_and_add(&fakeCopies, 1);
    return OK;
}

CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr p) {
    if (!current) return ERR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    Alloc *a = find(p);
    int host = 0;
    for (int i = 0; i < MAX_ALLOCS && !a; i++)
        if (pinned[i].used && p >= pinned[i].base && p < pinned[i].base + pinned[i].size) host = 1;
    pthread_mutex_unlock(&lock);
    if (!a && !host) return ERR_INVALID_VALUE;
    if (attribute == 2) { *(unsigned int *)data = a ? 2 : 1; return OK; }  /* MEMORY_TYPE */
    if (attribute == 9) { *(int *)data = 0; return OK; }                  /* DEVICE_ORDINAL */
    return ERR_INVALID_VALUE;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    Alloc *a = find(p);
    if (a) { *base = a->base; *size = a->size; }
    pthread_mutex_unlock(&lock);
    return a ? OK : ERR_INVALID_VALUE;
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    Alloc *a = find(p);
    int ok = a && a->base == p && !a->opened;
    if (ok) { memset(handle, 0, sizeof *handle); memcpy(handle->reserved, a->name, strlen(a->name)); }
    pthread_mutex_unlock(&lock);
    return ok ? OK : ERR_INVALID_VALUE;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle handle, unsigned int flags) {
    (void)flags;
    if (!current) return ERR_INVALID_CONTEXT;
    char name[65];
    memcpy(name, handle.reserved, 64); name[64] = 0;
    int pid = 0;
    if (sscanf(name, "/fakecuda-%d-", &pid) != 1) return ERR_INVALID_VALUE;
    if (pid == (int)getpid()) return ERR_INVALID_CONTEXT;  /* as CUDA: not in the exporting process */
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) return ERR_INVALID_VALUE;
    off_t size = lseek(fd, 0, SEEK_END);
    void *m = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return ERR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    Alloc *a = slot();
    a->base = (CUdeviceptr)(uintptr_t)m; a->size = (size_t)size; a->used = 1; a->opened = 1;
    strncpy(a->name, name, sizeof a->name - 1);
    pthread_mutex_unlock(&lock);
    *p = a->base;
    return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    Alloc *a = find(p);
    int ok = a && a->opened && a->base == p;
    if (ok) { munmap((void *)(uintptr_t)a->base, a->size); a->used = 0; }
    pthread_mutex_unlock(&lock);
    return ok ? OK : ERR_INVALID_VALUE;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
    (void)flags;
    if (!current) return ERR_INVALID_CONTEXT;
    uintptr_t b = (uintptr_t)p;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (pinned[i].used && b < pinned[i].base + pinned[i].size && pinned[i].base < b + n) {
            pthread_mutex_unlock(&lock);
            return ERR_ALREADY_REGISTERED;
        }
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!pinned[i].used) { pinned[i].base = b; pinned[i].size = n; pinned[i].used = 1; break; }
    pthread_mutex_unlock(&lock);
    return OK;
}

CUresult cuMemHostUnregister(void *p) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (pinned[i].used && pinned[i].base == (uintptr_t)p) { pinned[i].used = 0; pthread_mutex_unlock(&lock); return OK; }
    pthread_mutex_unlock(&lock);
    return ERR_NOT_REGISTERED;
}

CUresult cuGetErrorName(CUresult code, const char **name) {
    switch (code) {
    case OK: *name = "CUDA_SUCCESS"; return OK;
    case ERR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case ERR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
    case ERR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
    case ERR_ALREADY_REGISTERED: *name = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"; return OK;
    case ERR_NOT_REGISTERED: *name = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; return OK;
    default: *name = NULL; return ERR_INVALID_VALUE;
    }
}
