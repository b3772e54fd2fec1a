// The kernel-path switches (ops/include/hierpar/switches.h): one declaration each, scopes that nest and restore,
// and the CPU route they select.
#include "testing.h"

#include "hierpar/ops.h"
#include "hierpar/switches.h"

#include <set>
#include <string>

namespace {

TEST(Switches, EachIsDeclaredOnceWithItsVariable) {
  std::set<int> seen;
  std::set<std::string> variables;
  for (const hierpar::SwitchInfo& info : hierpar::switches()) {
    EXPECT_TRUE(seen.insert(static_cast<int>(info.which)).second) << info.variable << " declared twice";
    EXPECT_TRUE(variables.insert(info.variable).second) << info.variable << " names two switches";
    EXPECT_EQ(std::string(info.variable).rfind("HIERPAR_", 0), 0u) << info.variable;
    EXPECT_FALSE(std::string(info.meaning).empty()) << info.variable;
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(hierpar::Switch::poison_outputs) + 1);
}

TEST(Switches, ScopesNestAndRestore) {
  using hierpar::Switch;
  const bool before = hierpar::switch_on(Switch::side_stream), cluster = hierpar::switch_on(Switch::bn_cluster);
  {
    const hierpar::SwitchScope off(Switch::side_stream, false);
    EXPECT_FALSE(hierpar::switch_on(Switch::side_stream));
    {
      const hierpar::SwitchScope on(Switch::side_stream, true);
      EXPECT_TRUE(hierpar::switch_on(Switch::side_stream));
    }
    EXPECT_FALSE(hierpar::switch_on(Switch::side_stream));
    EXPECT_EQ(hierpar::switch_on(Switch::bn_cluster), cluster) << "a scope changes only its own switch";
  }
  EXPECT_EQ(hierpar::switch_on(Switch::side_stream), before);
}

// The test runner's environment (HIERPAR_POISON_OUTPUTS=1, set by tests/testing.cpp's main) reaches the switch.
TEST(Switches, EnvironmentSetsTheDefault) { EXPECT_TRUE(hierpar::switch_on(hierpar::Switch::poison_outputs)); }

}  // namespace
