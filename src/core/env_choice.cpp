#include "core/env_choice.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/env_names.h"
#include "epx/error.h"

namespace epx::detail {

int env_choice(const char* name, std::initializer_list<const char*> choices) {
  warn_unknown_env_names_once();
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  int i = 0;
  std::string listed;
  for (const char* c : choices) {
    if (std::strcmp(v, c) == 0) return i;
    listed += (i == 0 ? "" : i + 1 == static_cast<int>(choices.size()) ? " or " : ", ") + std::string(c);
    ++i;
  }
  throw Error(Status::kInvalidArgument, concat("epx: ", name, " is \"", v, "\", expected ", listed));
}

bool parse_int(const char* text, int& out) {
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || n < INT_MIN || n > INT_MAX) return false;
  out = static_cast<int>(n);
  return true;
}

int env_positive_int(const char* name, int fallback) {
  warn_unknown_env_names_once();
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int n = 0;
  if (!parse_int(v, n) || n <= 0)
    throw Error(Status::kInvalidArgument, concat("epx: ", name, " is \"", v, "\", expected a positive integer"));
  return n;
}

double env_positive_number(const char* name, double fallback, double max) {
  warn_unknown_env_names_once();
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v, &end);
  if (end == v || *end != '\0' || errno != 0 || !std::isfinite(x) || x <= 0 || x > max)
    throw Error(Status::kInvalidArgument,
                concat("epx: ", name, " is \"", v, "\", expected a positive number up to ", max));
  return x;
}

}  // namespace epx::detail
