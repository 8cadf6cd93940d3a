// The shm backend's front in C++ (backend/front.py): the c10d Backend that torch
// dispatches to. A small float32 SUM or AVG allreduce of one contiguous CPU tensor, a
// barrier, a small broadcast and a small all_gather_into_tensor are the call ring's one
// hand-off (shm_call of call_native.c, through the pointers the Python
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
#include <cstring>
#include <unordered_map>
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
          int64_t ring, int64_t line, int local_world, int local_rank, int64_t carried, int mode,
          std::vector<at::Tensor> dtypes, std::vector<int64_t> kinds, double slice_s, py::object counted)
        : c10d::Backend(rank, size), inner_(inner.cast<c10::intrusive_ptr<c10d::Backend>>()), py_(inner),
          counted_(std::move(counted)), plan_(reinterpret_cast<void *>(plan)),
          mode_word_(reinterpret_cast<int32_t *>(mode_word)), progress_(reinterpret_cast<Progress *>(progress)),
          fn_(reinterpret_cast<call_fn>(fn)), ring_(reinterpret_cast<char *>(ring)), line_(line), L_(local_world),
          me_(local_rank), carried_(carried), mode_(mode), slice_s_(slice_s), gate_(std::make_shared<Gate>()) {
        TORCH_CHECK(kinds.size() == KINDS, "the front takes ", int(KINDS), " kind codes");
        for (int k = 0; k < KINDS; k++)
            kind_[k] = kinds[k];
        for (size_t code = 0; code < dtypes.size(); code++) // a dtype's header code: its index
            dtype_code_[static_cast<int>(dtypes[code].scalar_type())] = static_cast<int64_t>(code);
    }

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
        if (gate_->armed.load(std::memory_order_acquire) && t.size() == 1 && movable(t[0]) &&
            o.rootRank >= 0 && o.rootRank < L_) {
            WorkPtr work = fast_call(BROADCAST, t[0], t[0], false, o.rootRank, t);
            if (work)
                return work;
        }
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
        WorkPtr work = fast_gather(out, in);
        return work ? work : inner_->all_gather_single(out, in, o);
    }
    WorkPtr _allgather_base(at::Tensor &out, at::Tensor &in, const c10d::AllgatherOptions &o) override {
        WorkPtr work = fast_gather(out, in);
        return work ? work : inner_->_allgather_base(out, in, o);
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
            at::Tensor none;
            std::vector<at::Tensor> nothing;
            WorkPtr work = fast_call(BARRIER, none, none, false, 1, nothing); // extra 1, as the Python path
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
    // header kinds the front sends, in the order of the codes handed to it
    enum Kind { SUM = 0, AVG, BARRIER, BROADCAST, ALL_GATHER, KINDS };
    static constexpr const char *NAMES[KINDS] = {"all_reduce", "all_reduce", "barrier", "broadcast",
                                                 "all_gather_into_tensor"};

    // A tensor the call ring carries whole: on the CPU, contiguous, of a dtype the headers name.
    bool movable(const at::Tensor &t) const {
        return t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous() && t.numel() > 0 &&
               static_cast<int64_t>(t.numel() * t.element_size()) <= carried_ &&
               dtype_code_.count(static_cast<int>(t.scalar_type()));
    }

    // The call ring's hand-off of one small float32 SUM/AVG; null where the call is not one.
    WorkPtr fast_allreduce(std::vector<at::Tensor> &tensors, const c10d::AllreduceOptions &opts) {
        at::Tensor &t = tensors[0];
        const auto op = opts.reduceOp.op_;
        const bool mean = op == c10d::ReduceOp::AVG;
        if (!(op == c10d::ReduceOp::SUM || mean) || !t.device().is_cpu() || t.layout() != c10::kStrided ||
            t.scalar_type() != at::kFloat || !t.is_contiguous() || t.numel() * 4 > carried_)
            return WorkPtr();
        return fast_call(mean ? AVG : SUM, t, t, mean, 1, tensors);
    }

    WorkPtr fast_gather(at::Tensor &out, at::Tensor &in) {
        if (!gate_->armed.load(std::memory_order_acquire) || !movable(in) || !out.is_contiguous() ||
            out.device() != in.device() || out.scalar_type() != in.scalar_type() ||
            out.numel() != in.numel() * L_ || out.layout() != c10::kStrided)
            return WorkPtr();
        std::vector<at::Tensor> result{out};
        return fast_call(ALL_GATHER, in, out, false, 1, result);
    }

    // One call through the call ring: its header (numel and dtype of `in`, `kind`, `extra`:
    // the root or the count of tensors) and `in`'s bytes (all but a barrier's, a non-root's
    // broadcast), then the op's result into `out`; null where the gate is not free or a
    // profiler records (the Python path's events are gloo's). `result`: the Work's tensors.
    WorkPtr fast_call(Kind kind, at::Tensor &in, at::Tensor &out, bool mean, int64_t extra,
                      const std::vector<at::Tensor> &result) {
        if (at::hasCallbacks())
            return WorkPtr();
        int expected = 0;
        if (!gate_->busy.compare_exchange_strong(expected, 1, std::memory_order_acquire))
            return WorkPtr(); // another thread's call holds the ring: the Python path waits for it
        if (!gate_->armed.load(std::memory_order_acquire)) {
            gate_->busy.store(0, std::memory_order_release);
            return WorkPtr();
        }
        const bool data = kind != BARRIER;
        const int64_t n = data ? in.numel() : 0;
        const int64_t nbytes = data ? n * static_cast<int64_t>(in.element_size()) : 0;
        const int64_t code = data ? dtype_code_.at(static_cast<int>(in.scalar_type())) : dtype_code_.at(
                                                                                            static_cast<int>(at::kByte));
        const int64_t header[8] = {n, code, kind_[kind], extra, 0, 0, 0, 0};
        const bool sends = data && !(kind == BROADCAST && extra != me_);
        const bool sums = kind == SUM || kind == AVG;
        progress_->pos = 0;
        progress_->phase = 0;
        *mode_word_ = mode_;
        void *src = sends ? in.data_ptr() : nullptr;
        const int rc = fn_(plan_, progress_, header, src, sends ? nbytes : 0, sums ? static_cast<float *>(src) : nullptr,
                           sums ? n : 0, mean ? 1 : 0, slice_s_);
        if (rc == 0) {
            copy_out(kind, in, out, nbytes, extra);
            gate_->busy.store(0, std::memory_order_release);
            if (data)
                torch::autograd::impl::bump_version(out); // written through a raw pointer
            gate_->fast.fetch_add(1);
            {
                py::gil_scoped_acquire gil;
                counted_(NAMES[kind]);
            }
            return c10::make_intrusive<DoneWork>(result);
        }
        // not done at once: the Python backend finishes it (and leaves the gate)
        py::gil_scoped_acquire gil;
        py::object a = data ? py::cast(in) : py::none(), b = data ? py::cast(out) : py::none();
        return c10::make_intrusive<HeldWork>(py_.attr("_finish_fast")(NAMES[kind], rc, a, b, mean, extra));
    }

    // After the hand-off of call progress_->seq: a broadcast's root bytes, every rank's piece
    // of an all_gather (a sum is already in place).
    void copy_out(Kind kind, const at::Tensor &in, at::Tensor &out, int64_t nbytes, int64_t root) {
        const char *slot = ring_ + (progress_->seq % 2) * L_ * line_ + 64; // a line's header: 64 bytes
        if (kind == BROADCAST && root != me_) {
            std::memcpy(out.data_ptr(), slot + root * line_, nbytes);
        } else if (kind == ALL_GATHER) {
            char *whole = static_cast<char *>(out.data_ptr());
            for (int r = 0; r < L_; r++)
                std::memcpy(whole + r * nbytes, r == me_ ? static_cast<const char *>(in.data_ptr()) : slot + r * line_,
                            nbytes);
        }
    }

    c10::intrusive_ptr<c10d::Backend> inner_;
    py::object py_;
    py::object counted_;
    void *plan_;
    int32_t *mode_word_;
    Progress *progress_;
    call_fn fn_;
    char *ring_;
    int64_t line_;
    int L_, me_;
    int64_t carried_;
    int mode_;
    int64_t kind_[KINDS];
    std::unordered_map<int, int64_t> dtype_code_;
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
        .def(py::init<py::object, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                      int64_t, int, std::vector<at::Tensor>, std::vector<int64_t>, double, py::object>())
        .def("gate", &Front::gate)
        .def_property_readonly("inner", &Front::inner)
        .def("__getattr__", [](const Front &self, const std::string &name) { return self.inner().attr(name.c_str()); });
}
