// Which device runs the generator (G) and which runs the discriminator (D) for each replica of an
// adversarial pair, and how replicas average their gradients: a plain value that comes from the flags
// `--strategy single|task|data|hierarchical --gpus N --reduce host|nccl`, validates and prints.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace hierpar::strategy {

// single: G and D on one device. task: G on one device, D on another (2 devices).
// data: R replicas, each holding G and D on one device (R devices). hierarchical: R replicas, each
// with G on one device and D on another (2R devices); seed 000's 4-GPU layout is R = 2.
enum class Scheme { single, task, data, hierarchical };

// host: gradients are averaged in pinned host memory by CPU threads (seed 000's way).
// collective: gradients are all-reduced by a c10d process group (NCCL on CUDA, Gloo on CPU); the flag
// spells it `nccl`.
enum class Reduce { host, collective };

Scheme parse_scheme(const std::string& name);  // "single" | "task" | "data" | "hierarchical"
Reduce parse_reduce(const std::string& name);  // "host" | "nccl" | "collective"
const char* to_string(Scheme scheme);
const char* to_string(Reduce reduce);

// How this process was launched: torchrun (or any launcher) sets RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; one process per replica then. A plain start is rank 0 of 1.
struct Launch {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  // torchrun's agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT and says so with
  // TORCHELASTIC_USE_AGENT_STORE=True: then every rank connects to it as a client (rank 0 must not bind).
  bool agent_store = false;
  // Started by torchrun (TORCHELASTIC_RUN_ID is set): its agent is this process's parent.
  bool torchrun = false;

  static Launch from_env();  // the variables above; missing ones keep the defaults
  bool multi_process() const { return world_size > 1; }
};

// Which of a replica's networks a process runs. whole: both (each on its device). generator / discriminator: one,
// when a task or hierarchical placement runs one process per device (torchrun --nproc-per-node = --gpus): ranks 2r
// and 2r + 1 run replica r's G and D, and the fakes and their gradient travel between the two processes.
enum class ReplicaPart { whole, generator, discriminator };
const char* to_string(ReplicaPart part);

struct ReplicaDevices {
  int64_t replica;  // global replica index: rank * replicas per process + local index (rank / 2 for a part)
  c10::Device generator;
  c10::Device discriminator;  // for a part: both name this process's one device
  ReplicaPart part = ReplicaPart::whole;
};

struct Placement {
  Scheme scheme = Scheme::single;
  Reduce reduce = Reduce::host;
  std::vector<ReplicaDevices> replicas;  // the replicas this process runs
  Launch launch;

  int64_t local_replicas() const { return static_cast<int64_t>(replicas.size()); }
  int64_t global_replicas() const { return split() ? launch.world_size / 2 : local_replicas() * launch.world_size; }
  // Whether each process runs one network of one replica (ReplicaPart), and the rank that runs the other.
  bool split() const { return !replicas.empty() && replicas[0].part != ReplicaPart::whole; }
  int64_t peer_rank() const { return launch.rank ^ 1; }

  // The placement for `devices` devices of `device_type` in all (over every process of `launch`):
  // CUDA devices are numbered from 0 within each process (LOCAL_RANK picks this process's share, unless
  // CUDA_VISIBLE_DEVICES leaves the process exactly its share, as SLURM's --gpus-per-task does: then it takes
  // them all); CPU "devices" are all the CPU, which lets tests run every scheme without a GPU.
  // task and hierarchical with one device per process (devices == WORLD_SIZE, an even count) split each replica over
  // two processes (ReplicaPart).
  // Throws with a message naming the flag for an impossible request: unknown names, too few
  // visible GPUs, an odd count for hierarchical, a device count that does not fit the processes.
  static Placement make(Scheme scheme, int64_t devices, Reduce reduce,
                        c10::DeviceType device_type = c10::DeviceType::CUDA, const Launch& launch = {});
  static Placement from_flags(const std::string& strategy, int64_t gpus, const std::string& reduce,
                              c10::DeviceType device_type = c10::DeviceType::CUDA,
                              const Launch& launch = Launch::from_env());

  // Re-checks a placement built or edited by hand: replica count, devices exist, scheme's shape.
  void validate() const;
  std::string to_string() const;
};

// e.g. "hierarchical: replica 0: G cuda:0, D cuda:1 | replica 1: G cuda:2, D cuda:3; reduce=nccl"
// (", rank 1 of 2 processes" is added under a multi-process launch); a part: "task: replica 0: D cuda:0 (G on
// rank 0); reduce=nccl, rank 1 of 2 processes".
std::ostream& operator<<(std::ostream& out, const Placement& placement);

}  // namespace hierpar::strategy
