/* The C route of ccalloc as CuPy's allocator (ccalloc_torch/cupy.py).
 *
 * CuPy's CFunctionAllocator calls a C malloc(param, size, device) and free(param, ptr,
 * device) through function pointers, with no Python object of the allocator's per block.
 * This module supplies those two functions. They call libccalloc.so's hook entry points,
 * whose addresses bind() receives from Python (so this module never loads a second copy of
 * the library), and ask CuPy for its current stream: through the C function CuPy's own pool
 * calls (a Cython capsule of cupy_backends.cuda.stream) when its signature is the one
 * expected, else through cupy.cuda.get_current_stream().ptr.
 *
 * A failed malloc raises a Python exception (CuPy holds the GIL when it calls the allocator)
 * and returns (void*)-1: CuPy's Cython wrappers return the pointer as an integer whose
 * error value is -1, and check for an exception when they see it. cupy.py checks that this
 * build of CuPy does so (probe()) before it uses this route.
 *
 * Built for CPython's stable ABI (3.9 and later): one file serves every interpreter. */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef void *(*hook_malloc_fn)(size_t size, int device, void *stream);
typedef void (*hook_free_fn)(void *ptr, int device);
typedef int (*last_status_fn)(void);
typedef const char *(*last_error_fn)(void);
typedef intptr_t (*stream_ptr_fn)(void);

enum { kOutOfMemory = 1 }; /* CCALLOC_ERROR_OUT_OF_MEMORY (ccalloc/ccalloc.h) */

struct route {
  hook_malloc_fn malloc;
  hook_free_fn free;
  last_status_fn last_status;
  last_error_fn last_error;
  stream_ptr_fn stream_ptr;   /* CuPy's C function, or NULL */
  PyObject *current_stream;   /* cupy.cuda.get_current_stream, when stream_ptr is NULL */
  PyObject *out_of_memory;    /* the exception class of a failed malloc for lack of memory */
  int probe;                  /* the probe's route: every malloc fails with ProbeError */
};

/* One route per process: CuPy keeps its address (param) for the allocator's lifetime. */
static struct route the_route;
static struct route probe_route = {.probe = 1};
static PyObject *probe_error;

#define FAILED ((void *)(intptr_t)-1)

static int current_stream(struct route *r, void **stream) {
  if (r->stream_ptr != NULL) {
    intptr_t s = r->stream_ptr();
    if (s == -1 && PyErr_Occurred()) return -1;
    *stream = (void *)s;
    return 0;
  }
  PyObject *object = PyObject_CallObject(r->current_stream, NULL);
  if (object == NULL) return -1;
  PyObject *ptr = PyObject_GetAttrString(object, "ptr");
  Py_DECREF(object);
  if (ptr == NULL) return -1;
  *stream = PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  return *stream == NULL && PyErr_Occurred() ? -1 : 0;
}

static void *route_malloc(void *param, size_t size, int device) {
  struct route *r = (struct route *)param;
  if (r->probe) {
    PyErr_SetString(probe_error, "ccalloc_torch.cupy: the probe's malloc fails by design");
    return FAILED;
  }
  if (r->malloc == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "ccalloc_torch.cupy: the C route is not bound");
    return FAILED;
  }
  void *stream = NULL;
  if (current_stream(r, &stream) != 0) return FAILED;
  void *ptr = r->malloc(size, device, stream);
  if (ptr != NULL) return ptr;
  const char *message = r->last_error();
  PyErr_Format(r->last_status() == kOutOfMemory ? r->out_of_memory : PyExc_RuntimeError,
               "ccalloc_torch.cupy: %zu bytes on device %d: %s", size, device,
               message != NULL && message[0] != '\0' ? message : "(no message)");
  return FAILED;
}

static void route_free(void *param, void *ptr, int device) {
  struct route *r = (struct route *)param;
  /* The probe hands nothing out; a CuPy that ignored the probe's exception keeps -1. */
  if (r->probe || ptr == FAILED || r->free == NULL) return;
  r->free(ptr, device); /* a failure goes to stderr: CuPy's free cannot raise */
}

static int address(PyObject *object, void **out, const char *what) {
  *out = PyLong_AsVoidPtr(object);
  if (*out == NULL) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "bind: %s is a null address", what);
    return -1;
  }
  return 0;
}

/* The capsule's name is the C signature Cython exports the function with; anything but
 * a function of no argument returning intptr_t is not called. */
static stream_ptr_fn stream_function(PyObject *capsule) {
  if (capsule == Py_None || !PyCapsule_CheckExact(capsule)) return NULL;
  const char *name = PyCapsule_GetName(capsule);
  if (name == NULL) {
    PyErr_Clear();
    return NULL;
  }
  static const char expected[] = "intptr_t (void)";
  size_t n = sizeof expected - 1;
  if (strncmp(name, expected, n) != 0 || (name[n] != '\0' && name[n] != ' ')) return NULL;
  void *f = PyCapsule_GetPointer(capsule, name);
  if (f == NULL) PyErr_Clear();
  return (stream_ptr_fn)f;
}

/* (param, malloc, free) for CuPy's CFunctionAllocator: `r` and the two functions. */
static PyObject *addresses(struct route *r) {
  return Py_BuildValue("(NNN)", PyLong_FromVoidPtr(r), PyLong_FromVoidPtr((void *)route_malloc),
                       PyLong_FromVoidPtr((void *)route_free));
}

/* bind(hook_malloc, hook_free, last_status, last_error, stream_capsule, get_current_stream,
 *      out_of_memory) -> (param, malloc, free): the addresses for CFunctionAllocator. */
static PyObject *bind(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *malloc_address, *free_address, *status_address, *error_address;
  PyObject *capsule, *get_stream, *oom;
  if (!PyArg_ParseTuple(args, "OOOOOOO:bind", &malloc_address, &free_address, &status_address,
                        &error_address, &capsule, &get_stream, &oom)) {
    return NULL;
  }
  void *m, *f, *s, *e;
  if (address(malloc_address, &m, "hook_malloc") || address(free_address, &f, "hook_free") ||
      address(status_address, &s, "last_status") || address(error_address, &e, "last_error")) {
    return NULL;
  }
  if (!PyCallable_Check(get_stream)) {
    PyErr_SetString(PyExc_TypeError, "bind: get_current_stream is not callable");
    return NULL;
  }
  if (!PyType_Check(oom) || !PyObject_IsSubclass(oom, PyExc_BaseException)) {
    PyErr_SetString(PyExc_TypeError, "bind: out_of_memory is not an exception class");
    return NULL;
  }
  stream_ptr_fn stream = stream_function(capsule);
  Py_INCREF(get_stream);
  Py_INCREF(oom);
  Py_XDECREF(the_route.current_stream);
  Py_XDECREF(the_route.out_of_memory);
  the_route.malloc = (hook_malloc_fn)m;
  the_route.free = (hook_free_fn)f;
  the_route.last_status = (last_status_fn)s;
  the_route.last_error = (last_error_fn)e;
  the_route.stream_ptr = stream;
  the_route.current_stream = get_stream;
  the_route.out_of_memory = oom;
  return addresses(&the_route);
}

/* probe() -> (param, malloc, free): a route whose malloc raises ProbeError. */
static PyObject *probe(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return addresses(&probe_route);
}

/* stream_source() -> "capsule", "python" or None (not bound). */
static PyObject *stream_source(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  if (the_route.malloc == NULL) Py_RETURN_NONE;
  return PyUnicode_FromString(the_route.stream_ptr != NULL ? "capsule" : "python");
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "Binds the route to libccalloc.so's hook entry points."},
    {"probe", probe, METH_NOARGS, "A route whose malloc raises ProbeError."},
    {"stream_source", stream_source, METH_NOARGS, "Where the route asks for CuPy's stream."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ccalloc_cupy",
                                    "ccalloc's C route for CuPy's CFunctionAllocator.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ccalloc_cupy(void) {
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  if (probe_error == NULL) {
    probe_error = PyErr_NewException("_ccalloc_cupy.ProbeError", PyExc_RuntimeError, NULL);
    if (probe_error == NULL) {
      Py_DECREF(m);
      return NULL;
    }
  }
  Py_INCREF(probe_error);
  if (PyModule_AddObject(m, "ProbeError", probe_error) != 0) {
    Py_DECREF(probe_error);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
