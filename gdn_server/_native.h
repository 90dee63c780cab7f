/* What gdn_server._native's source files share: each file adds its own functions to the module. */
#ifndef GDN_NATIVE_H
#define GDN_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* _native_scheduler.c: the scheduler's plain steps; 0 on success, -1 with an exception set. */
int add_scheduler_functions(PyObject *module);

/* _native_link.c: the engine's decode of front-end link frames; 0 on success, -1 with an exception set. */
int add_link_functions(PyObject *module);

#endif
