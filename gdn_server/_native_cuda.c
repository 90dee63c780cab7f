/* gdn_server._native, a small launch's host calls straight to the CUDA driver.

   cuda_current_context() -> int
       the calling thread's current CUDA context (0: none); raises RuntimeError where the driver
       library (libcuda.so.1) cannot be loaded, as on a host without a GPU.
   cuda_launch_graph(context, graph_exec, stream, event)
       launches an instantiated graph on `stream`, then records `event` on it.
   cuda_event_query(context, event) -> bool
       whether the work before `event`'s last record has finished.

   Every handle is the integer value of the driver's pointer (torch gives them:
   CUDAGraph.raw_cuda_graph_exec(), Stream.cuda_stream, Event.cuda_event). Each call makes
   `context` current for its duration and puts back the thread's own after, so the caller's CUDA
   runtime (torch) sees no change of device. Errors raise RuntimeError with the driver's message.

   Why: CudaBackend replays a CUDA graph per small launch. Through torch that is a stream context
   entered and left, CUDAGraph.replay and Event.record: ~76 us at one client on the H200 host
   with the caches cold between steps (bench/NOTES.md, trace_inline_v2), the largest of a step's
   server stages. The driver's own work is cuGraphLaunch and cuEventRecord.

   The GIL is held throughout: neither call blocks here (a backend keeps at most its staging
   ring's few launches queued on the stream, far below the driver's queue depth), and letting the
   GIL go and taking it back costs more than the calls at one client. */
#include "_native.h"
#include <dlfcn.h>

typedef int CUresult; /* CUDA_SUCCESS 0; CUDA_ERROR_NOT_READY 600 */
typedef void *CUcontext;
#define CU_SUCCESS 0
#define CU_NOT_READY 600

static struct {
    int tried;        /* dlopen attempted (once) */
    const char *why;  /* why the driver is not there, when it is not */
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*graph_launch)(void *, void *);
    CUresult (*event_record)(void *, void *);
    CUresult (*event_query)(void *);
    CUresult (*error_string)(CUresult, const char **);
} cu;

/* 0 when the driver's functions are resolved, else -1 with RuntimeError set. */
static int load_driver(void) {
    if (!cu.tried) {
        cu.tried = 1;
        /* already loaded by torch where there is a GPU; RTLD_NOLOAD is not used so that a host
           without it says so in the error below */
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL) {
            cu.why = "libcuda.so.1 could not be loaded (no NVIDIA driver on this host)";
        } else {
            struct { void **fn; const char *name; } wanted[] = {
                {(void **)&cu.ctx_get_current, "cuCtxGetCurrent"},
                {(void **)&cu.ctx_set_current, "cuCtxSetCurrent"},
                {(void **)&cu.graph_launch, "cuGraphLaunch"},
                {(void **)&cu.event_record, "cuEventRecord"},
                {(void **)&cu.event_query, "cuEventQuery"},
                {(void **)&cu.error_string, "cuGetErrorString"},
            };
            for (size_t i = 0; i < sizeof(wanted) / sizeof(wanted[0]); i++) {
                *wanted[i].fn = dlsym(lib, wanted[i].name);
                if (*wanted[i].fn == NULL) {
                    cu.why = "libcuda.so.1 lacks a function this module calls";
                    cu.ctx_get_current = NULL; /* marks the driver unusable */
                    break;
                }
            }
        }
    }
    if (cu.ctx_get_current == NULL) {
        PyErr_SetString(PyExc_RuntimeError, cu.why);
        return -1;
    }
    return 0;
}

static PyObject *driver_error(const char *what, CUresult rc) {
    const char *message = NULL;
    if (cu.error_string(rc, &message) != CU_SUCCESS || message == NULL) message = "unknown error";
    return PyErr_Format(PyExc_RuntimeError, "%s failed: CUDA error %d (%s)", what, rc, message);
}

/* Makes `want` current; *before gets the thread's own. 0, or -1 with an exception set. */
static int enter_context(CUcontext want, CUcontext *before) {
    CUresult rc = cu.ctx_get_current(before);
    if (rc != CU_SUCCESS) {
        driver_error("cuCtxGetCurrent", rc);
        return -1;
    }
    if (*before != want && (rc = cu.ctx_set_current(want)) != CU_SUCCESS) {
        driver_error("cuCtxSetCurrent", rc);
        return -1;
    }
    return 0;
}

static void leave_context(CUcontext want, CUcontext before) {
    if (before != want) cu.ctx_set_current(before);
}

static int as_handle(PyObject *value, void **handle) {
    *handle = PyLong_AsVoidPtr(value);
    return (*handle == NULL && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *cuda_current_context(PyObject *self, PyObject *unused) {
    if (load_driver() < 0) return NULL;
    CUcontext ctx = NULL;
    CUresult rc = cu.ctx_get_current(&ctx);
    if (rc != CU_SUCCESS) return driver_error("cuCtxGetCurrent", rc);
    return PyLong_FromVoidPtr(ctx);
}

static PyObject *cuda_launch_graph(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "cuda_launch_graph(context, graph_exec, stream, event) takes 4 arguments");
        return NULL;
    }
    void *ctx, *exec, *stream, *event;
    if (as_handle(args[0], &ctx) < 0 || as_handle(args[1], &exec) < 0 || as_handle(args[2], &stream) < 0 ||
        as_handle(args[3], &event) < 0)
        return NULL;
    if (load_driver() < 0) return NULL;
    if (exec == NULL || event == NULL) {
        PyErr_SetString(PyExc_ValueError, "cuda_launch_graph: a null graph or event handle");
        return NULL;
    }
    CUcontext before;
    if (enter_context(ctx, &before) < 0) return NULL;
    CUresult rc = cu.graph_launch(exec, stream);
    const char *what = "cuGraphLaunch";
    if (rc == CU_SUCCESS) {
        rc = cu.event_record(event, stream);
        what = "cuEventRecord";
    }
    leave_context(ctx, before);
    if (rc != CU_SUCCESS) return driver_error(what, rc);
    Py_RETURN_NONE;
}

static PyObject *cuda_event_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "cuda_event_query(context, event) takes 2 arguments");
        return NULL;
    }
    void *ctx, *event;
    if (as_handle(args[0], &ctx) < 0 || as_handle(args[1], &event) < 0) return NULL;
    if (load_driver() < 0) return NULL;
    if (event == NULL) {
        PyErr_SetString(PyExc_ValueError, "cuda_event_query: a null event handle");
        return NULL;
    }
    CUcontext before;
    if (enter_context(ctx, &before) < 0) return NULL;
    CUresult rc = cu.event_query(event);
    leave_context(ctx, before);
    if (rc == CU_SUCCESS) Py_RETURN_TRUE;
    if (rc == CU_NOT_READY) Py_RETURN_FALSE;
    return driver_error("cuEventQuery", rc);
}

static PyMethodDef cuda_methods[] = {
    {"cuda_current_context", cuda_current_context, METH_NOARGS,
     "cuda_current_context() -> int: the calling thread's current CUDA context (0: none)"},
    {"cuda_launch_graph", (PyCFunction)(void (*)(void))cuda_launch_graph, METH_FASTCALL,
     "cuda_launch_graph(context: int, graph_exec: int, stream: int, event: int) -> None"},
    {"cuda_event_query", (PyCFunction)(void (*)(void))cuda_event_query, METH_FASTCALL,
     "cuda_event_query(context: int, event: int) -> bool"},
    {NULL, NULL, 0, NULL},
};

int add_cuda_functions(PyObject *module) { return PyModule_AddFunctions(module, cuda_methods); }
