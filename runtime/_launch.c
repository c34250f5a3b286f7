/* flashkiln._launch: a plan's launches run from C (launch.run's native path).
 *
 * A call's Python work is bounded by what it does per launch: binding a parameter block (a copy,
 * its pointer fields set, its tensor maps re-pointed) and the driver's call through cuda-bindings.
 * Steps holds a plan's launches as plain data (the blocks as planned, and where each role's
 * address goes in them), so that one call binds and launches them all: per launch a copy, a few
 * stores, cuTensorMapReplaceAddress where an address moved, and cuLaunchKernel.
 *
 * No CUDA header or library at build time: the two driver entry points arrive as addresses
 * (cuGetProcAddress's, through cuda-bindings), so the module builds with a C compiler alone, and
 * tests hand it recording callbacks instead. The limited API (abi3) lets one build serve every
 * Python from 3.11 on.
 */
#define Py_LIMITED_API 0x030B0000
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* CUresult (*)(CUfunction, grid x y z, block x y z, shared bytes, CUstream, kernelParams, extra) */
typedef int (*LaunchKernelFn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                              void**, void**);
/* CUresult (*)(CUtensorMap*, void* address) */
typedef int (*ReplaceAddressFn)(void*, void*);

typedef struct {
  Py_ssize_t offset; /* byte offset in the block */
  Py_ssize_t role;   /* index into the roles */
  uintptr_t planned; /* tensor maps: the address the block's map was encoded for */
} Slot;

typedef struct {
  void* function;
  unsigned grid[3], block[3], smem_bytes;
  Py_ssize_t shared;  /* an earlier step whose bound block this one launches with, or -1 */
  Py_ssize_t nbytes;
  unsigned char* planned; /* the block as planned */
  unsigned char* bound;   /* this call's copy */
  Py_ssize_t npointers, nmaps;
  Slot* pointers;
  Slot* maps;
} Step;

typedef struct {
  PyObject_HEAD
  LaunchKernelFn launch_kernel;
  ReplaceAddressFn replace_address;
  Py_ssize_t nsteps, nroles;
  Step* steps;
  PyObject* roles;    /* a tuple of str: the keys of run's tensors, in slot order */
  PyObject* data_ptr; /* "data_ptr", the method that gives a tensor's address */
} Steps;

static void free_steps(Steps* self) {
  for (Py_ssize_t i = 0; i < self->nsteps; ++i) {
    free(self->steps[i].planned);
    free(self->steps[i].bound);
    free(self->steps[i].pointers);
    free(self->steps[i].maps);
  }
  free(self->steps);
  self->steps = NULL;
  self->nsteps = 0;
  Py_CLEAR(self->roles);
  Py_CLEAR(self->data_ptr);
}

static int as_size(PyObject* item, Py_ssize_t* out) {
  *out = PyLong_AsSsize_t(item);
  return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int as_unsigned(PyObject* item, unsigned* out) {
  const unsigned long value = PyLong_AsUnsignedLong(item);
  if (value == (unsigned long)-1 && PyErr_Occurred()) {
    return -1;
  }
  if (value > 0xffffffffUL) {
    PyErr_SetString(PyExc_OverflowError, "a launch dimension above 2**32 - 1");
    return -1;
  }
  *out = (unsigned)value;
  return 0;
}

static int as_pointer(PyObject* item, uintptr_t* out) {
  const unsigned long long value = PyLong_AsUnsignedLongLong(item);
  if (value == (unsigned long long)-1 && PyErr_Occurred()) {
    return -1;
  }
  *out = (uintptr_t)value;
  return 0;
}

/* Slots from a sequence of (offset, role) or, with `planned`, (offset, role, planned address). */
static int parse_slots(PyObject* seq, int planned, Py_ssize_t nbytes, Py_ssize_t nroles, Slot** out,
                       Py_ssize_t* count) {
  PyObject* fast = PySequence_Tuple(seq);
  if (fast == NULL) {
    return -1;
  }
  const Py_ssize_t n = PyTuple_Size(fast);
  Slot* slots = calloc(n ? (size_t)n : 1, sizeof(Slot));
  if (slots == NULL) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return -1;
  }
  const Py_ssize_t width = planned ? 128 : (Py_ssize_t)sizeof(void*); /* a CUtensorMap, or a pointer */
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* slot = PyTuple_GetItem(fast, i);
    if (!PyTuple_Check(slot) || PyTuple_Size(slot) != (planned ? 3 : 2) ||
        as_size(PyTuple_GetItem(slot, 0), &slots[i].offset) < 0 ||
        as_size(PyTuple_GetItem(slot, 1), &slots[i].role) < 0 ||
        (planned && as_pointer(PyTuple_GetItem(slot, 2), &slots[i].planned) < 0)) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, planned ? "a tensor-map slot is (offset, role, planned address)"
                                                 : "a pointer slot is (offset, role)");
      }
      free(slots);
      Py_DECREF(fast);
      return -1;
    }
    if (slots[i].offset < 0 || slots[i].offset + width > nbytes || slots[i].role < 0 || slots[i].role >= nroles) {
      PyErr_SetString(PyExc_ValueError, "a slot outside its parameter block or roles");
      free(slots);
      Py_DECREF(fast);
      return -1;
    }
  }
  Py_DECREF(fast);
  *out = slots;
  *count = n;
  return 0;
}

/* One step from (function, grid, block, shared bytes, planned block, pointer slots, map slots, shared). */
static int parse_step(PyObject* item, Py_ssize_t index, Py_ssize_t nroles, Step* step) {
  PyObject *function, *grid, *block, *smem, *planned, *pointers, *maps, *shared;
  if (!PyTuple_Check(item) || PyTuple_Size(item) != 8) {
    PyErr_SetString(PyExc_TypeError,
                    "a step is (function, grid, block, shared bytes, block bytes, pointer slots, map slots, shared)");
    return -1;
  }
  function = PyTuple_GetItem(item, 0);
  grid = PyTuple_GetItem(item, 1);
  block = PyTuple_GetItem(item, 2);
  smem = PyTuple_GetItem(item, 3);
  planned = PyTuple_GetItem(item, 4);
  pointers = PyTuple_GetItem(item, 5);
  maps = PyTuple_GetItem(item, 6);
  shared = PyTuple_GetItem(item, 7);
  uintptr_t address;
  if (as_pointer(function, &address) < 0) {
    return -1;
  }
  step->function = (void*)address;
  if (!PyTuple_Check(grid) || PyTuple_Size(grid) != 3 || !PyTuple_Check(block) || PyTuple_Size(block) != 3) {
    PyErr_SetString(PyExc_TypeError, "grid and block are 3-tuples");
    return -1;
  }
  for (int d = 0; d < 3; ++d) {
    if (as_unsigned(PyTuple_GetItem(grid, d), &step->grid[d]) < 0 ||
        as_unsigned(PyTuple_GetItem(block, d), &step->block[d]) < 0) {
      return -1;
    }
  }
  if (as_unsigned(smem, &step->smem_bytes) < 0 || as_size(shared, &step->shared) < 0) {
    return -1;
  }
  if (step->shared >= index || step->shared < -1) {
    PyErr_SetString(PyExc_ValueError, "a step shares the block of an earlier step, or none (-1)");
    return -1;
  }
  if (!PyBytes_Check(planned)) {
    PyErr_SetString(PyExc_TypeError, "a planned parameter block is bytes");
    return -1;
  }
  step->nbytes = PyBytes_Size(planned);
  /* 64-byte aligned, as a CUtensorMap is where the driver encodes one. */
  const size_t rounded = ((size_t)step->nbytes + 63) / 64 * 64;
  step->planned = malloc(step->nbytes ? (size_t)step->nbytes : 1);
  step->bound = aligned_alloc(64, rounded ? rounded : 64);
  if (step->planned == NULL || step->bound == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  memcpy(step->planned, PyBytes_AsString(planned), (size_t)step->nbytes);
  if (parse_slots(pointers, 0, step->nbytes, nroles, &step->pointers, &step->npointers) < 0 ||
      parse_slots(maps, 1, step->nbytes, nroles, &step->maps, &step->nmaps) < 0) {
    return -1;
  }
  return 0;
}

/* Steps(launch_kernel, replace_address, roles, steps): entry point addresses, the role names
 * (the keys of run's tensors; slots index them) and the steps. */
static int Steps_init(Steps* self, PyObject* args, PyObject* kwargs) {
  PyObject *launch_kernel, *replace_address, *roles, *items;
  if (kwargs != NULL && PyDict_Size(kwargs) > 0) {
    PyErr_SetString(PyExc_TypeError, "Steps takes positional arguments only");
    return -1;
  }
  if (!PyArg_ParseTuple(args, "OOOO", &launch_kernel, &replace_address, &roles, &items)) {
    return -1;
  }
  uintptr_t launch_address, replace;
  if (as_pointer(launch_kernel, &launch_address) < 0 || as_pointer(replace_address, &replace) < 0) {
    return -1;
  }
  if (launch_address == 0 || replace == 0) {
    PyErr_SetString(PyExc_ValueError, "a null driver entry point");
    return -1;
  }
  if (!PyTuple_Check(roles)) {
    PyErr_SetString(PyExc_TypeError, "roles: a tuple of str");
    return -1;
  }
  const Py_ssize_t nroles = PyTuple_Size(roles);
  for (Py_ssize_t r = 0; r < nroles; ++r) {
    if (!PyUnicode_Check(PyTuple_GetItem(roles, r))) {
      PyErr_SetString(PyExc_TypeError, "roles: a tuple of str");
      return -1;
    }
  }
  free_steps(self);
  self->launch_kernel = (LaunchKernelFn)launch_address;
  self->replace_address = (ReplaceAddressFn)replace;
  self->nroles = nroles;
  self->roles = Py_NewRef(roles);
  self->data_ptr = PyUnicode_InternFromString("data_ptr");
  if (self->data_ptr == NULL) {
    free_steps(self);
    return -1;
  }
  PyObject* fast = PySequence_Tuple(items);
  if (fast == NULL) {
    free_steps(self);
    return -1;
  }
  const Py_ssize_t n = PyTuple_Size(fast);
  self->steps = calloc(n ? (size_t)n : 1, sizeof(Step));
  if (self->steps == NULL) {
    Py_DECREF(fast);
    free_steps(self);
    PyErr_NoMemory();
    return -1;
  }
  self->nsteps = n;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (parse_step(PyTuple_GetItem(fast, i), i, nroles, &self->steps[i]) < 0) {
      Py_DECREF(fast);
      free_steps(self);
      return -1;
    }
  }
  Py_DECREF(fast);
  return 0;
}

/* A role's address from the call's value for it: an int as it is (a scratch role's address), else
 * the tensor's data_ptr(), as the Python loop reads it. */
static int role_address(Steps* self, PyObject* tensors, Py_ssize_t r, uintptr_t* out) {
  PyObject* role = PyTuple_GetItem(self->roles, r);
  PyObject* value = PyObject_GetItem(tensors, role);
  if (value == NULL) {
    return -1;
  }
  int status;
  if (PyLong_CheckExact(value)) {
    status = as_pointer(value, out);
  } else {
    PyObject* address = PyObject_CallMethodObjArgs(value, self->data_ptr, NULL);
    status = address == NULL ? -1 : as_pointer(address, out);
    Py_XDECREF(address);
  }
  Py_DECREF(value);
  return status;
}

static void Steps_dealloc(Steps* self) {
  free_steps(self);
  PyTypeObject* type = Py_TYPE((PyObject*)self);
  freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
  tp_free(self);
  Py_DECREF(type);
}

/* run(stream, tensors): every step bound to the addresses of `tensors` (a mapping from each role to
 * its tensor, or to an int address) and launched on `stream`, in order. None, or at the first
 * failure (what, step, CUresult) for the caller to raise: the driver's error names live on the
 * Python side. The blocks are the object's own, reused across calls: the GIL, held throughout,
 * keeps two calls apart, and cuLaunchKernel has read a block when it returns. */
static PyObject* Steps_run(Steps* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "run(stream, tensors)");
    return NULL;
  }
  uintptr_t stream;
  if (as_pointer(args[0], &stream) < 0) {
    return NULL;
  }
  PyObject* tensors = args[1];
  uintptr_t stack[32];
  uintptr_t* values = self->nroles <= 32 ? stack : malloc((size_t)self->nroles * sizeof(uintptr_t));
  if (values == NULL) {
    return PyErr_NoMemory();
  }
  PyObject* result = NULL;
  for (Py_ssize_t r = 0; r < self->nroles; ++r) {
    if (role_address(self, tensors, r, &values[r]) < 0) {
      goto done;
    }
  }
  for (Py_ssize_t i = 0; i < self->nsteps; ++i) {
    Step* step = &self->steps[i];
    unsigned char* params = step->bound;
    if (step->shared >= 0) {
      params = self->steps[step->shared].bound;
    } else {
      memcpy(params, step->planned, (size_t)step->nbytes);
      for (Py_ssize_t p = 0; p < step->npointers; ++p) {
        memcpy(params + step->pointers[p].offset, &values[step->pointers[p].role], sizeof(void*));
      }
      for (Py_ssize_t m = 0; m < step->nmaps; ++m) {
        const Slot* slot = &step->maps[m];
        if (values[slot->role] != slot->planned) {
          const int err = self->replace_address(params + slot->offset, (void*)values[slot->role]);
          if (err != 0) {
            result = Py_BuildValue("(sni)", "cuTensorMapReplaceAddress", i, err);
            goto done;
          }
        }
      }
    }
    void* kernel_params[1] = {params};
    const int err = self->launch_kernel(step->function, step->grid[0], step->grid[1], step->grid[2], step->block[0],
                                        step->block[1], step->block[2], step->smem_bytes, (void*)stream,
                                        kernel_params, NULL);
    if (err != 0) {
      result = Py_BuildValue("(sni)", "cuLaunchKernel", i, err);
      goto done;
    }
  }
  result = Py_NewRef(Py_None);
done:
  if (values != stack) {
    free(values);
  }
  return result;
}

static PyMethodDef Steps_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Steps_run, METH_FASTCALL,
     "run(stream, tensors): bind and launch every step; None, or (what, step, CUresult)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Steps_slots[] = {
    {Py_tp_doc, "A plan's launches, bound and run from C."},
    {Py_tp_init, Steps_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Steps_dealloc},
    {Py_tp_methods, Steps_methods},
    {0, NULL},
};

static PyType_Spec Steps_spec = {
    "flashkiln._launch.Steps", sizeof(Steps), 0, Py_TPFLAGS_DEFAULT, Steps_slots,
};

static int launch_exec(PyObject* module) {
  PyObject* type = PyType_FromSpec(&Steps_spec);
  if (type == NULL) {
    return -1;
  }
  if (PyModule_AddObject(module, "Steps", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}

static PyModuleDef_Slot launch_slots[] = {
    {Py_mod_exec, launch_exec},
    {0, NULL},
};

static struct PyModuleDef launch_module = {
    PyModuleDef_HEAD_INIT, "flashkiln._launch", "A plan's launches run from C (flashkiln.launch).", 0, NULL,
    launch_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__launch(void) { return PyModuleDef_Init(&launch_module); }
