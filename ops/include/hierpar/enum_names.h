#pragma once
// An enum's names, stated once in a table of {value, name} pairs that both its to_string and its parser read,
// so that the name printed for a value is the name parsed back to it.
#include <c10/util/Exception.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace hierpar {

template <typename Enum, std::size_t N>
using EnumNames = std::array<std::pair<Enum, const char*>, N>;

// "?" for a value the table does not name (a value cast from an out-of-range integer).
template <typename Enum, std::size_t N>
constexpr const char* name_of(const EnumNames<Enum, N>& names, Enum value) {
  for (const auto& [known, name] : names) {
    if (known == value) return name;
  }
  return "?";
}

template <typename Enum, std::size_t N>
std::optional<Enum> value_named(const EnumNames<Enum, N>& names, std::string_view name) {
  for (const auto& [value, known] : names) {
    if (name == known) return value;
  }
  return std::nullopt;
}

// The names in table order for an error message: "a, b or c" with the default last_separator.
template <typename Enum, std::size_t N>
std::string listed_names(const EnumNames<Enum, N>& names, const char* last_separator = " or ") {
  std::string list;
  for (std::size_t i = 0; i < N; ++i) {
    if (i > 0) list += i + 1 == N ? last_separator : ", ";
    list += names[i].second;
  }
  return list;
}

// The value named `name`; otherwise throws c10::Error "<what>: expected a, b or c, got '<name>'".
template <typename Enum, std::size_t N>
Enum parse_name(const EnumNames<Enum, N>& names, const std::string& name, const char* what) {
  const std::optional<Enum> value = value_named(names, name);
  TORCH_CHECK(value.has_value(), what, ": expected ", listed_names(names), ", got '", name, "'");
  return *value;
}

}  // namespace hierpar
