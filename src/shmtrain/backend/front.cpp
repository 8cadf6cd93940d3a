// The shm backend's front in C++ (backend/front.py): the c10d Backend that torch
// dispatches to. A small float32 SUM or AVG allreduce of one contiguous CPU tensor, and a
// barrier, is the call ring's one hand-off (shm_call of call_native.c, through the pointers the Python
// backend hands over) without entering Python; every other call, and the rest of any call
// that did not finish at once (a wait past its time slice, an abort, headers that differ),
// goes to the Python backend, the `inner`, through its own c10d methods.
//
// One call at a time uses the call ring: the gate's `busy` word, which the fast path takes
// with a compare-and-swap and the Python path with enter() (held through a call the Python
// path finishes for the fast one). The Python backend arms the gate while its calls may
// take the fast path (one host, the compiled library, nothing queued for its thread, not
// failed or closed).
#include <torch/python.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>
#include <sched.h>

namespace {

using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

// int shm_call(plan, progress, header, payload, nbytes, sum, n, mean, budget_s)
typedef int (*call_fn)(const void *, void *, const int64_t *, const void *, int64_t, float *, int64_t, int,
                       double);

struct Progress { // struct progress of pipeline_wait.h
    int64_t pos;
    int64_t seq;
    int32_t phase;
    int32_t waiting;
    int32_t wakes;
};

struct Gate {
    std::atomic<int> armed{0};
    std::atomic<int> busy{0};
    std::atomic<int64_t> fast{0}; // calls the fast path finished
};

class GateHandle { // the Python backend's view of the gate
  public:
    explicit GateHandle(std::shared_ptr<Gate> gate) : gate_(std::move(gate)) {}
    void arm(bool on) { gate_->armed.store(on ? 1 : 0, std::memory_order_release); }
    void enter() { // blocking; the caller released the GIL
        int expected = 0;
        while (!gate_->busy.compare_exchange_weak(expected, 1, std::memory_order_acquire)) {
            expected = 0;
            sched_yield();
        }
    }
    void leave() { gate_->busy.store(0, std::memory_order_release); }
    int64_t fast() const { return gate_->fast.load(); }

  private:
    std::shared_ptr<Gate> gate_;
};

// A finished call's Work (the fast path's): its future holds the tensors.
class DoneWork : public Work {
  public:
    explicit DoneWork(const std::vector<at::Tensor> &tensors)
        : Work(-1, c10d::OpType::ALLREDUCE),
          future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
          tensors_(tensors) {
        future_->markCompleted(c10::IValue(tensors_));
    }
    bool isCompleted() override { return true; }
    bool isSuccess() const override { return true; }
    bool wait(std::chrono::milliseconds) override { return true; }
    std::vector<at::Tensor> result() override { return tensors_; }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  private:
    c10::intrusive_ptr<c10::ivalue::Future> future_;
    std::vector<at::Tensor> tensors_;
};

// A Work of the Python backend, kept alive with its Python object (as torch's own holder).
class HeldWork : public Work {
  public:
    explicit HeldWork(py::object work) : work_(work.cast<WorkPtr>()), py_(std::move(work)) {}
    ~HeldWork() override {
        if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            py_ = py::object();
        } else {
            py_.release();
        }
    }
    bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

  private:
    WorkPtr work_;
    py::object py_;
};

class Front : public c10d::Backend {
  public:
    // addresses: the call ring's plan, its mode word, its progress record, shm_call;
    // codes: the header's dtype code of float32, kind codes of SUM and AVG
    Front(py::object inner, int rank, int size, int64_t plan, int64_t mode_word, int64_t progress, int64_t fn,
          int64_t carried, int mode, int64_t float_code, int64_t sum_code, int64_t avg_code, int64_t byte_code,
          int64_t barrier_code, double slice_s, py::object counted)
        : c10d::Backend(rank, size), inner_(inner.cast<c10::intrusive_ptr<c10d::Backend>>()), py_(inner),
          counted_(std::move(counted)), plan_(reinterpret_cast<void *>(plan)),
          mode_word_(reinterpret_cast<int32_t *>(mode_word)), progress_(reinterpret_cast<Progress *>(progress)),
          fn_(reinterpret_cast<call_fn>(fn)), carried_(carried), mode_(mode), float_code_(float_code),
          sum_code_(sum_code), avg_code_(avg_code), byte_code_(byte_code), barrier_code_(barrier_code),
          slice_s_(slice_s), gate_(std::make_shared<Gate>()) {}

    ~Front() override {
        if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            py_ = py::object();
            counted_ = py::object();
        } else {
            py_.release();
            counted_.release();
        }
    }

    GateHandle gate() const { return GateHandle(gate_); }
    py::object inner() const { return py_; }
    const std::string getBackendName() const override { return "shm"; }

    WorkPtr allreduce(std::vector<at::Tensor> &tensors, const c10d::AllreduceOptions &opts) override {
        if (gate_->armed.load(std::memory_order_acquire) && tensors.size() == 1) {
            WorkPtr work = fast_allreduce(tensors, opts);
            if (work)
                return work;
        }
        return inner_->allreduce(tensors, opts);
    }

    // -- everything else: the Python backend's ------------------------------------------
    WorkPtr broadcast(std::vector<at::Tensor> &t, const c10d::BroadcastOptions &o) override {
        return inner_->broadcast(t, o);
    }
    WorkPtr allreduce_sparse(std::vector<at::Tensor> &t, const c10d::AllreduceOptions &o) override {
        return inner_->allreduce_sparse(t, o);
    }
    WorkPtr allreduce_coalesced(std::vector<at::Tensor> &t, const c10d::AllreduceCoalescedOptions &o) override {
        return inner_->allreduce_coalesced(t, o);
    }
    WorkPtr reduce(std::vector<at::Tensor> &t, const c10d::ReduceOptions &o) override {
        return inner_->reduce(t, o);
    }
    WorkPtr allgather(std::vector<std::vector<at::Tensor>> &out, std::vector<at::Tensor> &in,
                      const c10d::AllgatherOptions &o) override {
        return inner_->allgather(out, in, o);
    }
    WorkPtr all_gather_single(at::Tensor &out, at::Tensor &in, const c10d::AllgatherOptions &o) override {
        return inner_->all_gather_single(out, in, o);
    }
    WorkPtr _allgather_base(at::Tensor &out, at::Tensor &in, const c10d::AllgatherOptions &o) override {
        return inner_->_allgather_base(out, in, o);
    }
    WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>> &out, std::vector<at::Tensor> &in,
                                const c10d::AllgatherOptions &o) override {
        return inner_->allgather_coalesced(out, in, o);
    }
    WorkPtr all_gather_single_coalesced(std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
                                        const c10d::AllgatherOptions &o) override {
        return inner_->all_gather_single_coalesced(out, in, o);
    }
    WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
                                            const c10d::AllgatherOptions &o) override {
        return inner_->allgather_into_tensor_coalesced(out, in, o);
    }
    WorkPtr gather(std::vector<std::vector<at::Tensor>> &out, std::vector<at::Tensor> &in,
                   const c10d::GatherOptions &o) override {
        return inner_->gather(out, in, o);
    }
    WorkPtr gather_single(at::Tensor &out, at::Tensor &in, const c10d::GatherOptions &o) override {
        return inner_->gather_single(out, in, o);
    }
    WorkPtr gather_into_tensor(at::Tensor &out, at::Tensor &in, const c10d::GatherOptions &o) override {
        return inner_->gather_into_tensor(out, in, o);
    }
    WorkPtr scatter(std::vector<at::Tensor> &out, std::vector<std::vector<at::Tensor>> &in,
                    const c10d::ScatterOptions &o) override {
        return inner_->scatter(out, in, o);
    }
    WorkPtr reduce_scatter(std::vector<at::Tensor> &out, std::vector<std::vector<at::Tensor>> &in,
                           const c10d::ReduceScatterOptions &o) override {
        return inner_->reduce_scatter(out, in, o);
    }
    WorkPtr reduce_scatter_single(at::Tensor &out, at::Tensor &in, const c10d::ReduceScatterOptions &o) override {
        return inner_->reduce_scatter_single(out, in, o);
    }
    WorkPtr _reduce_scatter_base(at::Tensor &out, at::Tensor &in, const c10d::ReduceScatterOptions &o) override {
        return inner_->_reduce_scatter_base(out, in, o);
    }
    WorkPtr reduce_scatter_single_coalesced(std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
                                            const c10d::ReduceScatterOptions &o) override {
        return inner_->reduce_scatter_single_coalesced(out, in, o);
    }
    WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
                                            const c10d::ReduceScatterOptions &o) override {
        return inner_->reduce_scatter_tensor_coalesced(out, in, o);
    }
    WorkPtr all_to_all_single(at::Tensor &out, at::Tensor &in, std::vector<int64_t> &out_splits,
                              std::vector<int64_t> &in_splits, const c10d::AllToAllOptions &o) override {
        return inner_->all_to_all_single(out, in, out_splits, in_splits, o);
    }
    WorkPtr alltoall_base(at::Tensor &out, at::Tensor &in, std::vector<int64_t> &out_splits,
                          std::vector<int64_t> &in_splits, const c10d::AllToAllOptions &o) override {
        return inner_->alltoall_base(out, in, out_splits, in_splits, o);
    }
    WorkPtr alltoall(std::vector<at::Tensor> &out, std::vector<at::Tensor> &in,
                     const c10d::AllToAllOptions &o) override {
        return inner_->alltoall(out, in, o);
    }
    void monitoredBarrier(const c10d::BarrierOptions &o, bool wait_all) override {
        inner_->monitoredBarrier(o, wait_all);
    }
    void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
    uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
    WorkPtr send(std::vector<at::Tensor> &t, int dst, int tag) override { return inner_->send(t, dst, tag); }
    WorkPtr recv(std::vector<at::Tensor> &t, int src, int tag) override { return inner_->recv(t, src, tag); }
    WorkPtr recvAnysource(std::vector<at::Tensor> &t, int tag) override { return inner_->recvAnysource(t, tag); }
    WorkPtr barrier(const c10d::BarrierOptions &o) override {
        if (gate_->armed.load(std::memory_order_acquire)) {
            WorkPtr work = fast_call(nullptr, false, false);
            if (work)
                return work;
        }
        return inner_->barrier(o);
    }
    void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
    void setGroupUid(const std::string &uid) override {
        c10d::Backend::setGroupUid(uid);
        inner_->setGroupUid(uid);
    }
    void abort() override { inner_->abort(); }
    void shutdown() override { inner_->shutdown(); }

  private:
    // The call ring's hand-off of one small float32 SUM/AVG; null where the call is not one.
    WorkPtr fast_allreduce(std::vector<at::Tensor> &tensors, const c10d::AllreduceOptions &opts) {
        at::Tensor &t = tensors[0];
        const auto op = opts.reduceOp.op_;
        const bool mean = op == c10d::ReduceOp::AVG;
        if (!(op == c10d::ReduceOp::SUM || mean) || !t.device().is_cpu() || t.layout() != c10::kStrided ||
            t.scalar_type() != at::kFloat || !t.is_contiguous() || t.numel() * 4 > carried_)
            return WorkPtr();
        return fast_call(&tensors, true, mean);
    }

    // One call through the call ring: an allreduce of `tensors` (its one float32 tensor) or,
    // where `reduce` is false, a barrier (the header alone); null where the gate is not free.
    WorkPtr fast_call(std::vector<at::Tensor> *tensors, bool reduce, bool mean) {
        if (at::hasCallbacks()) // a profiler records: the Python path's events are gloo's
            return WorkPtr();
        int expected = 0;
        if (!gate_->busy.compare_exchange_strong(expected, 1, std::memory_order_acquire))
            return WorkPtr(); // another thread's call holds the ring: the Python path waits for it
        if (!gate_->armed.load(std::memory_order_acquire)) {
            gate_->busy.store(0, std::memory_order_release);
            return WorkPtr();
        }
        const int64_t n = reduce ? (*tensors)[0].numel() : 0;
        const int64_t header[8] = {n, reduce ? float_code_ : byte_code_,
                                   reduce ? (mean ? avg_code_ : sum_code_) : barrier_code_, 1, 0, 0, 0, 0};
        progress_->pos = 0;
        progress_->phase = 0;
        *mode_word_ = mode_;
        float *data = n ? (*tensors)[0].data_ptr<float>() : nullptr;
        const int rc = fn_(plan_, progress_, header, data, n * 4, reduce ? data : nullptr, n, mean ? 1 : 0, slice_s_);
        if (rc == 0) {
            gate_->busy.store(0, std::memory_order_release);
            if (reduce)
                torch::autograd::impl::bump_version((*tensors)[0]); // written through a raw pointer
            gate_->fast.fetch_add(1);
            {
                py::gil_scoped_acquire gil;
                counted_(reduce ? "all_reduce" : "barrier");
            }
            return c10::make_intrusive<DoneWork>(reduce ? *tensors : std::vector<at::Tensor>());
        }
        // not done at once: the Python backend finishes it (and leaves the gate)
        py::gil_scoped_acquire gil;
        py::object total = reduce ? py::cast((*tensors)[0]) : py::none();
        return c10::make_intrusive<HeldWork>(py_.attr("_finish_fast")(total, mean, rc));
    }

    c10::intrusive_ptr<c10d::Backend> inner_;
    py::object py_;
    py::object counted_;
    void *plan_;
    int32_t *mode_word_;
    Progress *progress_;
    call_fn fn_;
    int64_t carried_;
    int mode_;
    int64_t float_code_, sum_code_, avg_code_, byte_code_, barrier_code_;
    double slice_s_;
    std::shared_ptr<Gate> gate_;
};

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    py::class_<GateHandle>(m, "Gate")
        .def("arm", &GateHandle::arm)
        .def("enter", &GateHandle::enter, py::call_guard<py::gil_scoped_release>())
        .def("leave", &GateHandle::leave)
        .def_property_readonly("fast", &GateHandle::fast);
    py::class_<Front, c10d::Backend, c10::intrusive_ptr<Front>>(m, "Front")
        .def(py::init<py::object, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int, int64_t, int64_t,
                      int64_t, int64_t, int64_t, double, py::object>())
        .def("gate", &Front::gate)
        .def_property_readonly("inner", &Front::inner)
        .def("__getattr__", [](const Front &self, const std::string &name) { return self.inner().attr(name.c_str()); });
}
