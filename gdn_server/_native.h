/* What gdn_server._native's source files share: each file adds its own functions to the module. */
#ifndef GDN_NATIVE_H
#define GDN_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* _native.c: helpers the other files share. */
/* A str of UTF-8 bytes; NULL without an exception set when they are not valid UTF-8. */
PyObject *utf8(const uint8_t *s, Py_ssize_t n);

/* Attribute or key names, each interned once into its slot. */
typedef struct {
    PyObject **slot;
    const char *name;
} InternedName;

/* Interns each name into its slot (once); 0 on success, -1 with an exception set. */
int intern_names(const InternedName *names, size_t count);

/* _native_replies.c: copies n bytes into memory another process reads next (a link ring), with
   stores that bypass this core's caches where the CPU has them (x86-64), else memcpy. */
void copy_for_another_core(void *dst, const void *src, size_t n);

/* _native_scheduler.c: the scheduler's plain steps; 0 on success, -1 with an exception set. */
int add_scheduler_functions(PyObject *module);

/* _native_link.c: the engine's decode of front-end link frames and its reply writer (LinkSender);
   0 on success, -1 with an exception set. */
int add_link_functions(PyObject *module);

/* _native_replies.c: ReplyBox, one link connection's replies; 0 on success, -1 with an exception set. */
int add_reply_box(PyObject *module);

/* _native_cuda.c: a small launch's graph launch and event record, straight to the CUDA driver
   (opened at first use); 0 on success, -1 with an exception set. */
int add_cuda_functions(PyObject *module);

#endif
