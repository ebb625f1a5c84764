/* tsukimi.transfer._native: the two loops of a small same-host transfer that the interpreter made
 * the limit (profile in docs/benchmarks.md, "Same host, 64 KiB x 4: native loops").
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
    return PyModule_Create(&module);
}
