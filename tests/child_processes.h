// The ranks of a multi-process run as child processes of a test: this test binary (a worker test picked
// by --gtest_filter) or a program, started with the launch environment (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT) and a log file each, waited for with a deadline after which a rank still
// running is killed and reported as hung, and timed (seconds from start to exit).
#pragma once

#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace hierpar::testing {

// A TCP port on 127.0.0.1 that was free a moment ago.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t length = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    if (fd >= 0) ::close(fd);
    return 29500 + static_cast<int>(::getpid() % 1000);
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

inline std::string self_executable() {
  std::string exe(4096, '\0');
  const ssize_t length = ::readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  exe.resize(length > 0 ? static_cast<size_t>(length) : 0);
  return exe;
}

// The variables a launcher gives rank `rank` of `world` processes meeting at 127.0.0.1:`port`.
inline std::map<std::string, std::string> launch_environment(int rank, int world, int port) {
  return {{"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)}};
}

struct Child {
  pid_t pid = -1;
  int status = -1;
  std::string log;
  double seconds = -1;  // from spawn() to its exit
  std::chrono::steady_clock::time_point started;
};

// Starts `argv` with this process's environment less any launch variables and gtest's sharding ones (a worker
// test picked by --gtest_filter runs whichever shard its parent ran in), plus `env`, its stdout and stderr into `log`.
inline Child spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                   const std::string& log) {
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    if (key != "RANK" && key != "WORLD_SIZE" && key != "LOCAL_RANK" && key != "MASTER_ADDR" && key != "MASTER_PORT" &&
        key.rfind("TORCHELASTIC_", 0) != 0 && key != "GTEST_TOTAL_SHARDS" && key != "GTEST_SHARD_INDEX" &&
        env.count(key) == 0) {
      entries.push_back(entry);
    }
  }
  for (const auto& [k, v] : env) entries.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : entries) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = argv;
  std::vector<char*> argp;
  for (auto& a : args) argp.push_back(a.data());
  argp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  Child child;
  child.log = log;
  child.started = std::chrono::steady_clock::now();
  const int rc = posix_spawnp(&child.pid, args[0].c_str(), &actions, nullptr, argp.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << "could not start " << args[0];
  if (rc != 0) child.pid = -1;
  return child;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Waits for every child, at most `limit` from now; one still running then is killed and reported as hung.
inline void wait_all(std::vector<Child>& children, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (bool running = true; running;) {
    running = false;
    for (auto& child : children) {
      if (child.pid <= 0 || child.seconds >= 0) continue;
      if (::waitpid(child.pid, &child.status, WNOHANG) == child.pid) {
        child.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - child.started).count();
      } else if (std::chrono::steady_clock::now() > deadline) {
        ::kill(child.pid, SIGKILL);
        ::waitpid(child.pid, &child.status, 0);
        child.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - child.started).count();
        ADD_FAILURE() << "a rank hung: killed after " << limit.count() << " s; its log:\n" << read_text(child.log);
        child.status = -1;
      } else {
        running = true;
      }
    }
    if (running) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The exit status, or minus the signal that ended the child.
inline int exit_code(const Child& child) {
  if (WIFEXITED(child.status)) return WEXITSTATUS(child.status);
  if (WIFSIGNALED(child.status)) return -WTERMSIG(child.status);
  return -1000;
}

// POSIX calls, not std::filesystem: libtorch.so exports std::filesystem symbols of its own toolchain,
// which the dynamic linker may pick instead of libstdc++'s (remove_all crashed that way).
inline std::string temp_dir(const std::string& name) {
  std::string pattern = "/tmp/hierpar_" + name + "_XXXXXX";
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr) << "mkdtemp " << pattern;
  return pattern;
}

// Removes a folder and its files (not subfolders).
inline void remove_dir(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") ::unlink((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

// Removes a folder tree.
inline void remove_tree(const std::string& dir) {
  ::nftw(dir.c_str(), [](const char* file, const struct stat*, int, struct FTW*) { return ::remove(file); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

}  // namespace hierpar::testing
