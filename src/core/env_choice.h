// The kernel-choice and tuning environment variables (EPX_ROUTER_KERNEL, EPX_COMBINE_ITEMS,
// EPX_TIMEOUT_S, ...): a value the library does not know is a typo that would otherwise run another
// kernel or wait another time without a word, so it is an error that names the variable, the value
// and what was expected.
#pragma once

#include <initializer_list>

namespace epx::detail {

/// The index of the value of environment variable `name` among `choices`, or -1 where it is unset or
/// empty. Any other value throws Error (kInvalidArgument) naming the variable and every choice.
int env_choice(const char* name, std::initializer_list<const char*> choices);

/// `text` as a whole number in int's range (decimal, an optional sign, nothing after it): true with
/// `out` set, else false and `out` untouched.
bool parse_int(const char* text, int& out);

/// A positive integer from environment variable `name`, or `fallback` where it is unset or empty.
/// Anything else (zero, negative, not a whole number) throws Error naming the variable.
int env_positive_int(const char* name, int fallback);

/// A positive finite number up to `max` from environment variable `name` (e.g. "2.5", "1e-3"), or
/// `fallback` where it is unset or empty. Anything else throws Error naming the variable.
double env_positive_number(const char* name, double fallback, double max);

}  // namespace epx::detail
