/* tsukimi.transfer._native: the loops of a small same-host transfer where the interpreter was the
 * limit (profile in docs/benchmarks.md, "Same host, 64 KiB x 4: native loops").
 *
 *   copy_packed(packed)  memmove each (destination, source, bytes) triple of a buffer of
 *                        native uint64s, with the GIL released (ctypes.memmove costs ~0.3 us
 *                        a call; a 64 KiB copy ~1.5 us).
 *   memo_key(requests)   the plan memo's key of a request list (tsukimi/transfer/plan_memo.py
 *                        `PlanMemo.key`, which stays the reference and the fallback): the
 *                        same flat tuple, or None where that returns None (tests/transfer/
 *                        test_native.py holds them equal).
 *   still_there(pidfd, fds)  a same-host peer's liveness and its files' links, in one call
 *                        (select.select and os.fstat from Python cost ~1.1 us together).
 *   cma_run(pidfd, pid, version_address, version, groups)
 *                        a cma prepared call (transports/cma.py) in one call: the pidfd
 *                        polled, the owner's registration version read, each group's
 *                        process_vm_readv/writev (the GIL released), the pidfd polled again
 *                        (from Python: ~5 us around ~8 us of copying).
 *   configure(...)       the classes and markers memo_key compares against (once, at import).
 *
 * Optional: setup.py builds it where a C compiler is present; tsukimi/transfer/native.py falls back to
 * the Python code without it (or with TSUKIMI_NATIVE=0). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>

static PyObject *host_classes;  /* tuple of exact classes whose buffers are keyed */
static PyObject *opcode_cls, *read_op, *handle_cls, *by_name, *by_address;
static PyObject *s_op, *s_segment, *s_remote_offset, *s_local, *s_length, *s_local_offset;
static PyObject *s_handle_id, *s_name, *s_transport, *zero;

static PyObject *copy_packed(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len % (3 * sizeof(uint64_t)) != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "copy_packed: the buffer is not whole (dst, src, n) uint64 triples");
        return NULL;
    }
    const uint64_t *t = (const uint64_t *)view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)(3 * sizeof(uint64_t));
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++, t += 3)
        memmove((void *)(uintptr_t)t[0], (const void *)(uintptr_t)t[1], (size_t)t[2]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

/* still_there(pidfd, fds): whether the process the pidfd pins still runs (the pidfd is not
 * readable) and each file descriptor's file is still linked (its owner did not release it);
 * False too when any descriptor is bad. */
static PyObject *still_there(PyObject *self, PyObject *args) {
    int pidfd;
    PyObject *fds;
    if (!PyArg_ParseTuple(args, "iO!:still_there", &pidfd, &PyTuple_Type, &fds))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fds);
    int wanted[8];
    if (n > 8) {
        PyErr_SetString(PyExc_ValueError, "still_there: at most 8 files");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(fds, i));
        if (fd == -1 && PyErr_Occurred())
            return NULL;
        if (fd < 0 || fd > INT_MAX) {
            PyErr_SetString(PyExc_ValueError, "still_there: a file descriptor is out of range");
            return NULL;
        }
        wanted[i] = (int)fd;
    }
    struct pollfd p = {.fd = pidfd, .events = POLLIN, .revents = 0};
    int there = pidfd >= 0 && poll(&p, 1, 0) == 0;  /* NOTE: poll ignores a negative fd; a closed one is POLLNVAL */
    struct stat st;
    for (Py_ssize_t i = 0; there && i < n; i++)
        there = fstat(wanted[i], &st) == 0 && st.st_nlink > 0;
    return PyBool_FromLong(there);
}

#define CMA_IOV_MAX 1024

static int pid_running(int pidfd) {
    struct pollfd p = {.fd = pidfd, .events = POLLIN, .revents = 0};
    return pidfd >= 0 && poll(&p, 1, 0) == 0;
}

/* cma_run(pidfd, pid, version_address, version, groups): groups is a tuple of (write,
 * packed, nbytes): `packed` holds (local address, remote address, length) uint64 triples, at
 * most 1024 of them, `nbytes` their sum. True when the owner ran before and after, its
 * registration version (when it publishes one, at version_address) is `version`, and every
 * call moved all of its bytes; else False (the caller redoes it the ordinary way). */
static PyObject *cma_run(PyObject *self, PyObject *args) {
    int pidfd, pid;
    unsigned long long version_address, version;
    PyObject *groups;
    if (!PyArg_ParseTuple(args, "iiKKO!:cma_run", &pidfd, &pid, &version_address, &version, &PyTuple_Type, &groups))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(groups);
    Py_buffer *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    int *writes = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(int));
    long long *sizes = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(long long));
    struct iovec *local = PyMem_Malloc(CMA_IOV_MAX * sizeof(struct iovec));
    struct iovec *remote = PyMem_Malloc(CMA_IOV_MAX * sizeof(struct iovec));
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    int moved = 1;
    if (!views || !writes || !sizes || !local || !remote) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        PyObject *group = PyTuple_GET_ITEM(groups, got);
        int write;
        if (!PyTuple_Check(group)) {
            PyErr_SetString(PyExc_TypeError, "cma_run: each group is a (write, packed, nbytes) tuple");
            goto done;
        }
        if (!PyArg_ParseTuple(group, "py*L:cma_run group", &write, &views[got], &sizes[got]))
            goto done;
        writes[got] = write;
        if (views[got].len % (Py_ssize_t)(3 * sizeof(uint64_t)) != 0 ||
            views[got].len / (Py_ssize_t)(3 * sizeof(uint64_t)) > CMA_IOV_MAX) {
            got++;
            PyErr_SetString(PyExc_ValueError, "cma_run: a group is not whole triples, or more than 1024");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (!pid_running(pidfd))
        moved = 0;
    if (moved && version_address) {
        uint64_t word = 0;
        struct iovec here = {.iov_base = &word, .iov_len = 8}, there = {.iov_base = (void *)(uintptr_t)version_address, .iov_len = 8};
        /* NOTE: a version that cannot be read is no version (as VersionWord.read): the copy says */
        if (process_vm_readv(pid, &here, 1, &there, 1, 0) == 8 && word != version)
            moved = 0;
    }
    for (Py_ssize_t g = 0; moved && g < n; g++) {
        const uint64_t *t = (const uint64_t *)views[g].buf;
        Py_ssize_t count = views[g].len / (Py_ssize_t)(3 * sizeof(uint64_t));
        for (Py_ssize_t i = 0; i < count; i++, t += 3) {
            local[i].iov_base = (void *)(uintptr_t)t[0];
            remote[i].iov_base = (void *)(uintptr_t)t[1];
            local[i].iov_len = remote[i].iov_len = (size_t)t[2];
        }
        ssize_t done_bytes = writes[g] ? process_vm_writev(pid, local, (unsigned long)count, remote, (unsigned long)count, 0)
                                       : process_vm_readv(pid, local, (unsigned long)count, remote, (unsigned long)count, 0);
        moved = done_bytes == (ssize_t)sizes[g];
    }
    if (moved && !pid_running(pidfd))
        moved = 0;
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(moved);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(writes);
    PyMem_Free(sizes);
    PyMem_Free(local);
    PyMem_Free(remote);
    return result;
}

static int is_host_class(PyTypeObject *type) {
    Py_ssize_t n = PyTuple_GET_SIZE(host_classes);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)type == PyTuple_GET_ITEM(host_classes, i))
            return 1;
    return 0;
}

/* Append one request's ten fields to `flat` (a list). 1: appended; 0: not memoizable
 * (the key is None); -1: an exception is set. */
static int key_one(PyObject *req, PyObject *flat) {
    PyObject *fields[10] = {NULL};
    PyObject *op = NULL, *segment = NULL, *remote = NULL, *local = NULL, *length = NULL, *local_offset = NULL;
    int result = -1, i;
    if (!(op = PyObject_GetAttr(req, s_op)) || !(segment = PyObject_GetAttr(req, s_segment)) ||
        !(remote = PyObject_GetAttr(req, s_remote_offset)) || !(local = PyObject_GetAttr(req, s_local)) ||
        !(length = PyObject_GetAttr(req, s_length)) || !(local_offset = PyObject_GetAttr(req, s_local_offset)))
        goto done;
    int is_tuple = PyTuple_CheckExact(local);
    if ((!is_tuple && !is_host_class(Py_TYPE(local))) || (PyObject *)Py_TYPE(op) != opcode_cls ||
        !PyLong_CheckExact(remote) || !PyLong_CheckExact(local_offset) || !(length == Py_None || PyLong_CheckExact(length))) {
        result = 0;
        goto done;
    }
    fields[0] = PyBool_FromLong(op == read_op);
    if ((PyObject *)Py_TYPE(segment) == handle_cls) {
        if (!(fields[1] = PyObject_GetAttr(segment, s_handle_id)) || !(fields[2] = PyObject_GetAttr(segment, s_name)) ||
            !(fields[3] = PyObject_GetAttr(segment, s_transport)))
            goto done;
    } else if (PyUnicode_CheckExact(segment)) {
        fields[1] = Py_NewRef(by_name);
        fields[2] = Py_NewRef(segment);
        fields[3] = Py_NewRef(by_name);
    } else {
        result = 0;
        goto done;
    }
    fields[4] = Py_NewRef(remote);
    fields[5] = Py_NewRef(local_offset);
    fields[6] = Py_NewRef(length);
    if (is_tuple) {  /* (address, length): the address is the key */
        if (PyTuple_GET_SIZE(local) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(local, 0)) ||
            !PyLong_CheckExact(PyTuple_GET_ITEM(local, 1))) {
            result = 0;
            goto done;
        }
        for (i = 0; i < 2; i++) {
            int positive = PyObject_RichCompareBool(PyTuple_GET_ITEM(local, i), zero, Py_GT);
            if (positive < 0)
                goto done;
            if (!positive) {
                result = 0;
                goto done;
            }
        }
        fields[7] = Py_NewRef(PyTuple_GET_ITEM(local, 0));
        fields[8] = Py_NewRef(PyTuple_GET_ITEM(local, 1));
        fields[9] = Py_NewRef(by_address);
    } else {
        Py_buffer view;
        /* NOTE: a simple buffer is a C-contiguous one: an exporter refuses it otherwise
         * (BufferError or ValueError), as a non-contiguous buffer is not memoizable */
        if (PyObject_GetBuffer(local, &view, PyBUF_SIMPLE) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError) &&
                !PyErr_ExceptionMatches(PyExc_BufferError))
                goto done;
            PyErr_Clear();  /* NOTE: as memoryview(local) raising: not memoizable */
            result = 0;
            goto done;
        }
        int readonly = view.readonly, usable = view.len > 0 &&
                                               !(readonly && op == read_op);
        void *address = view.buf;
        Py_ssize_t nbytes = view.len;
        PyBuffer_Release(&view);
        if (!usable) {
            result = 0;
            goto done;
        }
        if (!(fields[7] = PyLong_FromVoidPtr(address)) || !(fields[8] = PyLong_FromSsize_t(nbytes)))
            goto done;
        fields[9] = PyBool_FromLong(readonly);
    }
    for (i = 0; i < 10; i++)
        if (PyList_Append(flat, fields[i]) < 0)
            goto done;
    result = 1;
done:
    for (i = 0; i < 10; i++)
        Py_XDECREF(fields[i]);
    Py_XDECREF(op);
    Py_XDECREF(segment);
    Py_XDECREF(remote);
    Py_XDECREF(local);
    Py_XDECREF(length);
    Py_XDECREF(local_offset);
    return result;
}

static PyObject *memo_key(PyObject *self, PyObject *requests) {
    if (host_classes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tsukimi.transfer._native.configure was not called");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(requests, "memo_key: requests must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *flat = PyList_New(0), *result = NULL;
    if (flat == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int one = key_one(PySequence_Fast_GET_ITEM(seq, i), flat);
        if (one < 0)
            goto done;
        if (one == 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    result = PyList_AsTuple(flat);
done:
    Py_XDECREF(flat);
    Py_DECREF(seq);
    return result;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *hosts, *opcode, *read, *handle, *name_marker, *address_marker;
    if (!PyArg_ParseTuple(args, "O!OOOOO:configure", &PyTuple_Type, &hosts, &opcode, &read, &handle, &name_marker,
                          &address_marker))
        return NULL;
    Py_XSETREF(host_classes, Py_NewRef(hosts));
    Py_XSETREF(opcode_cls, Py_NewRef(opcode));
    Py_XSETREF(read_op, Py_NewRef(read));
    Py_XSETREF(handle_cls, Py_NewRef(handle));
    Py_XSETREF(by_name, Py_NewRef(name_marker));
    Py_XSETREF(by_address, Py_NewRef(address_marker));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_packed", copy_packed, METH_O, "memmove each (dst, src, n) uint64 triple of a buffer, GIL released; True."},
    {"memo_key", memo_key, METH_O, "The plan memo's key of a request list (None: not memoizable)."},
    {"still_there", still_there, METH_VARARGS, "still_there(pidfd, fds): the process runs and each file is linked."},
    {"cma_run", cma_run, METH_VARARGS, "cma_run(pidfd, pid, version_address, version, groups): a cma prepared call."},
    {"configure", configure, METH_VARARGS, "configure(host_classes, OpCode, OpCode.READ, SegmentHandle, by_name, by_address)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tsukimi.transfer._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    const char *names[] = {"op", "segment", "remote_offset", "local", "length", "local_offset",
                           "handle_id", "name", "transport"};
    PyObject **slots[] = {&s_op, &s_segment, &s_remote_offset, &s_local, &s_length, &s_local_offset,
                          &s_handle_id, &s_name, &s_transport};
    if (zero == NULL && !(zero = PyLong_FromLong(0)))
        return NULL;
    for (int i = 0; i < 9; i++)
        if (*slots[i] == NULL && !(*slots[i] = PyUnicode_InternFromString(names[i])))
            return NULL;
    PyObject *created = PyModule_Create(&module);
    /* NOTE: native.py loads only the version it was written for (a stale in-place build falls back) */
    if (created != NULL && PyModule_AddIntConstant(created, "VERSION", 1) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
