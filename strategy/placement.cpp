#include "hierpar/strategy/placement.h"

#include "hierpar/enum_names.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <optional>
#include <sstream>

namespace hierpar::strategy {
namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0', "environment variable ", name, " must be an integer, got \"", value, "\"");
  return parsed;
}

constexpr EnumNames<Scheme, 4> scheme_names{{{Scheme::single, "single"},
                                              {Scheme::task, "task"},
                                              {Scheme::data, "data"},
                                              {Scheme::hierarchical, "hierarchical"}}};

// --reduce also takes "collective", the enum's own name, for Reduce::collective.
constexpr EnumNames<Reduce, 2> reduce_names{{{Reduce::host, "host"}, {Reduce::collective, "nccl"}}};

int64_t devices_per_replica(Scheme scheme) {
  return (scheme == Scheme::task || scheme == Scheme::hierarchical) ? 2 : 1;
}

}  // namespace

Scheme parse_scheme(const std::string& name) {
  const std::optional<Scheme> scheme = value_named(scheme_names, name);
  TORCH_CHECK(scheme.has_value(), "--strategy must be one of ", listed_names(scheme_names, ", "), "; got \"", name,
              "\"");
  return *scheme;
}

Reduce parse_reduce(const std::string& name) {
  if (name == "collective") return Reduce::collective;
  const std::optional<Reduce> reduce = value_named(reduce_names, name);
  TORCH_CHECK(reduce.has_value(), "--reduce must be ", listed_names(reduce_names), "; got \"", name, "\"");
  return *reduce;
}

const char* to_string(Scheme scheme) { return name_of(scheme_names, scheme); }

const char* to_string(Reduce reduce) { return name_of(reduce_names, reduce); }

const char* to_string(ReplicaPart part) {
  constexpr EnumNames<ReplicaPart, 3> names{
      {{ReplicaPart::whole, "whole"}, {ReplicaPart::generator, "generator"}, {ReplicaPart::discriminator, "discriminator"}}};
  return name_of(names, part);
}

Launch Launch::from_env() {
  Launch launch;
  launch.rank = env_int("RANK", 0);
  launch.world_size = env_int("WORLD_SIZE", 1);
  launch.local_rank = env_int("LOCAL_RANK", launch.rank);
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0') launch.master_addr = addr;
  launch.master_port = env_int("MASTER_PORT", launch.master_port);
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE"); agent != nullptr) {
    launch.agent_store = std::string(agent) == "True";
  }
  if (const char* run = std::getenv("TORCHELASTIC_RUN_ID"); run != nullptr && *run != '\0') launch.torchrun = true;

  TORCH_CHECK(launch.world_size >= 1, "WORLD_SIZE must be at least 1, got ", launch.world_size);
  TORCH_CHECK(launch.rank >= 0 && launch.rank < launch.world_size, "RANK must be in [0, WORLD_SIZE=",
              launch.world_size, "), got ", launch.rank);
  TORCH_CHECK(launch.local_rank >= 0, "LOCAL_RANK must be non-negative, got ", launch.local_rank);
  return launch;
}

Placement Placement::make(Scheme scheme, int64_t devices, Reduce reduce, c10::DeviceType device_type,
                          const Launch& launch) {
  TORCH_CHECK(device_type == c10::DeviceType::CUDA || device_type == c10::DeviceType::CPU,
              "placement devices must be cuda or cpu, got ", c10::DeviceTypeName(device_type));
  TORCH_CHECK(devices >= 1, "--gpus must be at least 1, got ", devices);
  const int64_t processes = launch.world_size;
  if (scheme == Scheme::single || scheme == Scheme::task) {
    const int64_t needed = scheme == Scheme::single ? 1 : 2;
    TORCH_CHECK(devices == needed, "--strategy ", strategy::to_string(scheme), " uses exactly ", needed, " device",
                needed == 1 ? "" : "s", " (G and D on one each)", ", got --gpus ", devices,
                "; use data or hierarchical for more");
    TORCH_CHECK(scheme == Scheme::task || processes == 1, "--strategy single runs one replica in one process, but "
                "WORLD_SIZE=", processes, "; launch one process or use data/hierarchical");
    TORCH_CHECK(processes <= 2, "--strategy task runs in one process (G and D on one device each) or two (one device "
                "each), but WORLD_SIZE=", processes, "; use hierarchical for more");
  }
  if (scheme == Scheme::hierarchical) {
    TORCH_CHECK(devices % 2 == 0, "--strategy hierarchical needs an even --gpus (a G device and a D device per "
                "replica), got ", devices);
  }
  // task and hierarchical with one device per process: each process runs one network of a replica.
  const bool split = devices_per_replica(scheme) == 2 && devices == processes && processes > 1;
  const int64_t per_replica = split ? 1 : devices_per_replica(scheme);
  TORCH_CHECK(devices % (processes * per_replica) == 0, "--gpus ", devices, " does not split over WORLD_SIZE=",
              processes, " processes with ", per_replica, " device", per_replica == 1 ? "" : "s",
              " per replica: each process must hold whole replicas");
  const int64_t per_process = devices / processes;
  int64_t first = launch.local_rank * per_process;  // this process's first CUDA device
  if (device_type == c10::DeviceType::CUDA) {
    const int64_t visible = static_cast<int64_t>(torch::cuda::device_count());
    // CUDA_VISIBLE_DEVICES set per process (two torchrun agents on one host, SLURM's --gpus-per-task): it sees
    // only its own GPUs, numbered from 0.
    if (visible == per_process && first + per_process > visible && std::getenv("CUDA_VISIBLE_DEVICES") != nullptr) first = 0;
    TORCH_CHECK(first + per_process <= visible, "--gpus ", devices, " with --strategy ", strategy::to_string(scheme),
                " needs CUDA devices ", first, "..", first + per_process - 1, " in this process (LOCAL_RANK=",
                launch.local_rank, "), but only ", visible, " CUDA device", visible == 1 ? " is" : "s are",
                " visible");
  }
  auto device = [&](int64_t offset) {
    return device_type == c10::DeviceType::CUDA
               ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(first + offset))
               : c10::Device(c10::DeviceType::CPU);
  };

  Placement placement;
  placement.scheme = scheme;
  placement.reduce = reduce;
  placement.launch = launch;
  if (split) {
    const ReplicaPart part = launch.rank % 2 == 0 ? ReplicaPart::generator : ReplicaPart::discriminator;
    placement.replicas.push_back({launch.rank / 2, device(0), device(0), part});
  }
  const int64_t local = split ? 0 : per_process / per_replica;
  for (int64_t i = 0; i < local; ++i) {
    const int64_t g = i * per_replica;
    placement.replicas.push_back({launch.rank * local + i, device(g), device(g + per_replica - 1)});
  }
  placement.validate();
  return placement;
}

Placement Placement::from_flags(const std::string& strategy, int64_t gpus, const std::string& reduce,
                                c10::DeviceType device_type, const Launch& launch) {
  return make(parse_scheme(strategy), gpus, parse_reduce(reduce), device_type, launch);
}

void Placement::validate() const {
  TORCH_CHECK(!replicas.empty(), "a placement needs at least one replica");
  TORCH_CHECK(launch.world_size >= 1 && launch.rank >= 0 && launch.rank < launch.world_size,
              "placement launch: rank ", launch.rank, " is not in a world of ", launch.world_size);
  if (scheme == Scheme::single || scheme == Scheme::task) {
    TORCH_CHECK(global_replicas() == 1, "--strategy ", strategy::to_string(scheme), " has one replica, got ", global_replicas());
  }
  if (split()) {
    TORCH_CHECK(scheme == Scheme::task || scheme == Scheme::hierarchical, "--strategy ", strategy::to_string(scheme),
                " runs both networks of a replica in one process; only task and hierarchical split them");
    TORCH_CHECK(replicas.size() == 1 && launch.world_size % 2 == 0, "a split placement runs one network of one "
                "replica per process over an even number of processes, got ", replicas.size(), " replicas in rank ",
                launch.rank, " of ", launch.world_size);
    const ReplicaDevices& r = replicas[0];
    const ReplicaPart expected = launch.rank % 2 == 0 ? ReplicaPart::generator : ReplicaPart::discriminator;
    TORCH_CHECK(r.part == expected && r.replica == launch.rank / 2 && r.generator == r.discriminator,
                "rank ", launch.rank, " of a split placement runs the ", strategy::to_string(expected), " of replica ",
                launch.rank / 2, " on one device, got the ", strategy::to_string(r.part), " of replica ", r.replica, " on ",
                r.generator, " and ", r.discriminator);
    return;
  }
  for (size_t i = 0; i < replicas.size(); ++i) {
    const ReplicaDevices& r = replicas[i];
    TORCH_CHECK(r.part == ReplicaPart::whole, "replica ", r.replica, ": parts of replicas only in a split placement "
                "(one replica per process)");
    TORCH_CHECK(r.replica == launch.rank * local_replicas() + static_cast<int64_t>(i), "replica ", i,
                " of rank ", launch.rank, " must have global index ", launch.rank * local_replicas() + i,
                ", got ", r.replica);
    TORCH_CHECK(r.generator.type() == r.discriminator.type(), "replica ", r.replica,
                ": G and D must be on the same kind of device, got ", r.generator, " and ", r.discriminator);
    const bool same = r.generator == r.discriminator;
    if (scheme == Scheme::single || scheme == Scheme::data) {
      TORCH_CHECK(same, "--strategy ", strategy::to_string(scheme), " keeps G and D on one device, replica ", r.replica,
                  " has G on ", r.generator, " and D on ", r.discriminator);
    } else if (r.generator.is_cuda()) {
      TORCH_CHECK(!same, "--strategy ", strategy::to_string(scheme), " puts G and D on different GPUs, replica ", r.replica,
                  " has both on ", r.generator);
    }
    if (r.generator.is_cuda()) {
      for (size_t j = 0; j < i; ++j) {
        for (const c10::Device& d : {r.generator, r.discriminator}) {
          TORCH_CHECK(d != replicas[j].generator && d != replicas[j].discriminator, "device ", d,
                      " is used by replicas ", replicas[j].replica, " and ", r.replica, "; each GPU runs one network");
        }
      }
    }
  }
}

std::string Placement::to_string() const {
  std::ostringstream out;
  out << hierpar::strategy::to_string(scheme) << ": ";
  for (size_t i = 0; i < replicas.size(); ++i) {
    const ReplicaDevices& r = replicas[i];
    out << (i == 0 ? "" : " | ") << "replica " << r.replica << ": ";
    if (r.part == ReplicaPart::generator) {
      out << "G " << r.generator << " (D on rank " << peer_rank() << ")";
    } else if (r.part == ReplicaPart::discriminator) {
      out << "D " << r.discriminator << " (G on rank " << peer_rank() << ")";
    } else {
      out << "G " << r.generator << ", D " << r.discriminator;
    }
  }
  out << "; reduce=" << hierpar::strategy::to_string(reduce);
  if (launch.multi_process()) out << ", rank " << launch.rank << " of " << launch.world_size << " processes";
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Placement& placement) { return out << placement.to_string(); }

}  // namespace hierpar::strategy
