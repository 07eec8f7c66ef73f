/*
 * monarch_kernel.data._ibverbs: the RDMA hot path of the ibverbs transport.
 *
 * One Endpoint is one reliable-connected queue pair with its own protection domain and
 * completion queue.  Python exchanges the queue-pair details (LID, GID, QPN, PSN) over the
 * data plane's authenticated socket, then calls read()/write(), which post one-sided RDMA
 * READ/WRITE work requests and poll for their completion with the GIL released: the bytes
 * go NIC to NIC, and neither CPU copies them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <infiniband/verbs.h>
#include <string.h>
#include <time.h>

#define CHUNK (1u << 30) /* largest single work request */

typedef struct {
    PyObject_HEAD
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint8_t port;
    int gid_index;
    uint32_t psn;
    struct ibv_port_attr port_attr;
    union ibv_gid gid;
} Endpoint;

typedef struct {
    PyObject_HEAD
    struct ibv_mr *mr;
    PyObject *owner; /* keeps the endpoint (and so the PD) alive */
} Region;

static PyObject *verbs_error(const char *what, int err) {
    return PyErr_Format(PyExc_OSError, "%s failed: %s (errno %d)", what, strerror(err), err);
}

/* ------------------------------------------------------------------ probe */

static PyObject *probe(PyObject *self, PyObject *noargs) {
    int n = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (list == NULL) {
        int err = errno ? errno : ENODEV;
        return Py_BuildValue("(Os)", Py_False,
                             err == ENOSYS ? "no RDMA device: the kernel has no InfiniBand/RoCE support loaded here"
                                           : "no RDMA device: ibv_get_device_list() failed");
    }
    if (n == 0) {
        ibv_free_device_list(list);
        return Py_BuildValue("(Os)", Py_False, "no RDMA device: ibv_get_device_list() found none");
    }
    PyObject *names = PyList_New(0);
    for (int i = 0; i < n; i++) {
        PyObject *s = PyUnicode_FromString(ibv_get_device_name(list[i]));
        PyList_Append(names, s);
        Py_DECREF(s);
    }
    ibv_free_device_list(list);
    PyObject *sep = PyUnicode_FromString(", ");
    PyObject *joined = PyUnicode_Join(sep, names);
    Py_DECREF(sep);
    Py_DECREF(names);
    PyObject *msg = PyUnicode_FromFormat("%d RDMA device(s): %U", n, joined);
    Py_DECREF(joined);
    PyObject *out = Py_BuildValue("(ON)", Py_True, msg);
    return out;
}

/* ------------------------------------------------------------------ Endpoint */

static void Endpoint_dealloc(Endpoint *e) {
    if (e->qp) ibv_destroy_qp(e->qp);
    if (e->cq) ibv_destroy_cq(e->cq);
    if (e->pd) ibv_dealloc_pd(e->pd);
    if (e->ctx) ibv_close_device(e->ctx);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static int Endpoint_init(Endpoint *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"device", "port", "gid_index", NULL};
    const char *want = NULL;
    int port = 1, gid_index = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zii", kwlist, &want, &port, &gid_index)) return -1;
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (list == NULL || n == 0) {
        if (list) ibv_free_device_list(list);
        PyErr_SetString(PyExc_OSError, "no RDMA device on this host");
        return -1;
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++) {
        if (want == NULL || strcmp(want, ibv_get_device_name(list[i])) == 0) {
            dev = list[i];
            break;
        }
    }
    if (dev == NULL) {
        ibv_free_device_list(list);
        PyErr_Format(PyExc_OSError, "no RDMA device named %s", want);
        return -1;
    }
    e->ctx = ibv_open_device(dev);
    ibv_free_device_list(list);
    if (!e->ctx) { verbs_error("ibv_open_device", errno); return -1; }
    e->port = (uint8_t)port;
    e->gid_index = gid_index;
    if (ibv_query_port(e->ctx, e->port, &e->port_attr)) { verbs_error("ibv_query_port", errno); return -1; }
    if (ibv_query_gid(e->ctx, e->port, gid_index, &e->gid)) { verbs_error("ibv_query_gid", errno); return -1; }
    e->pd = ibv_alloc_pd(e->ctx);
    if (!e->pd) { verbs_error("ibv_alloc_pd", errno); return -1; }
    e->cq = ibv_create_cq(e->ctx, 64, NULL, NULL, 0);
    if (!e->cq) { verbs_error("ibv_create_cq", errno); return -1; }
    struct ibv_qp_init_attr qa;
    memset(&qa, 0, sizeof qa);
    qa.send_cq = e->cq;
    qa.recv_cq = e->cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = 32;
    qa.cap.max_recv_wr = 1;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    e->qp = ibv_create_qp(e->pd, &qa);
    if (!e->qp) { verbs_error("ibv_create_qp", errno); return -1; }
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = e->port;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    if (ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        verbs_error("ibv_modify_qp(INIT)", errno);
        return -1;
    }
    e->psn = (uint32_t)(time(NULL) ^ (uintptr_t)e) & 0xffffff;
    return 0;
}

static PyObject *Endpoint_info(Endpoint *e, PyObject *noargs) {
    return Py_BuildValue("{s:i,s:y#,s:I,s:I,s:i}", "lid", (int)e->port_attr.lid, "gid",
                         (const char *)e->gid.raw, (Py_ssize_t)16, "qpn", e->qp->qp_num, "psn", e->psn,
                         "mtu", (int)e->port_attr.active_mtu);
}

static PyObject *Endpoint_connect(Endpoint *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"lid", "gid", "qpn", "psn", "mtu", NULL};
    int lid, mtu;
    unsigned int qpn, psn;
    Py_buffer gid;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iy*IIi", kwlist, &lid, &gid, &qpn, &psn, &mtu)) return NULL;
    if (gid.len != 16) {
        PyBuffer_Release(&gid);
        return PyErr_Format(PyExc_ValueError, "a GID is 16 bytes, not %zd", gid.len);
    }
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = mtu < (int)e->port_attr.active_mtu ? (enum ibv_mtu)mtu : e->port_attr.active_mtu;
    a.dest_qp_num = qpn;
    a.rq_psn = psn;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = (uint16_t)lid;
    a.ah_attr.port_num = e->port;
    a.ah_attr.is_global = 1; /* RoCE needs the GRH; InfiniBand accepts it */
    memcpy(a.ah_attr.grh.dgid.raw, gid.buf, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)e->gid_index;
    a.ah_attr.grh.hop_limit = 64;
    PyBuffer_Release(&gid);
    if (ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return verbs_error("ibv_modify_qp(RTR)", errno);
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = e->psn;
    a.max_rd_atomic = 16;
    if (ibv_modify_qp(e->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                     IBV_QP_MAX_QP_RD_ATOMIC))
        return verbs_error("ibv_modify_qp(RTS)", errno);
    Py_RETURN_NONE;
}

static PyTypeObject RegionType;

static PyObject *Endpoint_register(Endpoint *e, PyObject *args) {
    unsigned long long addr, length;
    if (!PyArg_ParseTuple(args, "KK", &addr, &length)) return NULL;
    struct ibv_mr *mr = ibv_reg_mr(e->pd, (void *)(uintptr_t)addr, (size_t)length,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
    if (!mr) return verbs_error("ibv_reg_mr", errno);
    Region *r = PyObject_New(Region, &RegionType);
    if (!r) {
        ibv_dereg_mr(mr);
        return NULL;
    }
    r->mr = mr;
    Py_INCREF(e);
    r->owner = (PyObject *)e;
    return (PyObject *)r;
}

/* Post one-sided work requests for [local, local+length) <-> [remote, remote+length) and
 * wait for all of them; the GIL is released while the NIC works. */
static PyObject *transfer(Endpoint *e, PyObject *args, enum ibv_wr_opcode op) {
    unsigned long long local, remote, length;
    unsigned int lkey, rkey;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "KIKIKd", &local, &lkey, &remote, &rkey, &length, &timeout_s)) return NULL;
    int err = 0, status = IBV_WC_SUCCESS;
    const char *failed = NULL;
    Py_BEGIN_ALLOW_THREADS
    unsigned long long done = 0;
    int outstanding = 0;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while ((done < length || outstanding > 0) && !failed) {
        while (done < length && outstanding < 16) {
            uint32_t n = (uint32_t)((length - done) < CHUNK ? (length - done) : CHUNK);
            struct ibv_sge sge = {.addr = local + done, .length = n, .lkey = lkey};
            struct ibv_send_wr wr, *bad = NULL;
            memset(&wr, 0, sizeof wr);
            wr.wr_id = done;
            wr.sg_list = &sge;
            wr.num_sge = 1;
            wr.opcode = op;
            wr.send_flags = IBV_SEND_SIGNALED;
            wr.wr.rdma.remote_addr = remote + done;
            wr.wr.rdma.rkey = rkey;
            if ((err = ibv_post_send(e->qp, &wr, &bad)) != 0) {
                failed = "ibv_post_send";
                break;
            }
            done += n;
            outstanding++;
        }
        struct ibv_wc wc[16];
        int got = ibv_poll_cq(e->cq, 16, wc);
        if (got < 0) {
            failed = "ibv_poll_cq";
            err = EIO;
            break;
        }
        for (int i = 0; i < got; i++) {
            outstanding--;
            if (wc[i].status != IBV_WC_SUCCESS) {
                status = wc[i].status;
                failed = "work completion";
            }
        }
        if (got == 0 && timeout_s > 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9 > timeout_s) {
                failed = "timeout";
                err = ETIMEDOUT;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        if (status != IBV_WC_SUCCESS)
            return PyErr_Format(PyExc_ConnectionError, "RDMA %s failed: %s", op == IBV_WR_RDMA_READ ? "READ" : "WRITE",
                                ibv_wc_status_str((enum ibv_wc_status)status));
        if (err == ETIMEDOUT) return PyErr_Format(PyExc_TimeoutError, "RDMA transfer: no completion within %.1f s", timeout_s);
        return verbs_error(failed, err);
    }
    return PyLong_FromUnsignedLongLong(length);
}

static PyObject *Endpoint_read(Endpoint *e, PyObject *args) { return transfer(e, args, IBV_WR_RDMA_READ); }
static PyObject *Endpoint_write(Endpoint *e, PyObject *args) { return transfer(e, args, IBV_WR_RDMA_WRITE); }

static PyMethodDef Endpoint_methods[] = {
    {"info", (PyCFunction)Endpoint_info, METH_NOARGS, "This queue pair's lid, gid, qpn, psn and mtu."},
    {"connect", (PyCFunction)(void (*)(void))Endpoint_connect, METH_VARARGS | METH_KEYWORDS,
     "Connect to the peer queue pair described by its info()."},
    {"register", (PyCFunction)Endpoint_register, METH_VARARGS, "register(addr, length) -> Region"},
    {"read", (PyCFunction)Endpoint_read, METH_VARARGS,
     "read(local, lkey, remote, rkey, length, timeout_s): RDMA READ remote into local."},
    {"write", (PyCFunction)Endpoint_write, METH_VARARGS,
     "write(local, lkey, remote, rkey, length, timeout_s): RDMA WRITE local into remote."},
    {NULL},
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "monarch_kernel.data._ibverbs.Endpoint",
    .tp_basicsize = sizeof(Endpoint),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A reliable-connected queue pair on one RDMA device.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Endpoint_init,
    .tp_dealloc = (destructor)Endpoint_dealloc,
    .tp_methods = Endpoint_methods,
};

/* ------------------------------------------------------------------ Region */

static void Region_dealloc(Region *r) {
    if (r->mr) ibv_dereg_mr(r->mr);
    Py_XDECREF(r->owner);
    PyObject_Free(r);
}

static PyObject *Region_lkey(Region *r, void *c) { return PyLong_FromUnsignedLong(r->mr->lkey); }
static PyObject *Region_rkey(Region *r, void *c) { return PyLong_FromUnsignedLong(r->mr->rkey); }
static PyObject *Region_addr(Region *r, void *c) { return PyLong_FromUnsignedLongLong((uintptr_t)r->mr->addr); }

static PyGetSetDef Region_getset[] = {
    {"lkey", (getter)Region_lkey, NULL, "local key", NULL},
    {"rkey", (getter)Region_rkey, NULL, "remote key", NULL},
    {"addr", (getter)Region_addr, NULL, "start address", NULL},
    {NULL},
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "monarch_kernel.data._ibverbs.Region",
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A registered memory region; deregistered when collected.",
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_getset = Region_getset,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"probe", probe, METH_NOARGS, "probe() -> (available, reason)"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ibverbs", "RDMA READ/WRITE through libibverbs.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__ibverbs(void) {
    if (PyType_Ready(&EndpointType) < 0 || PyType_Ready(&RegionType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&EndpointType);
    PyModule_AddObject(m, "Endpoint", (PyObject *)&EndpointType);
    Py_INCREF(&RegionType);
    PyModule_AddObject(m, "Region", (PyObject *)&RegionType);
    return m;
}
