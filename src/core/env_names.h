// Every environment variable epx reads, in one list. Values are checked where they are read (a value
// a variable does not take is an error naming it); names cannot be: a misspelt EPX_TRANSPROT is read
// by nothing and silently changes nothing. So the library compares the EPX_* names set in its
// environment with this list once per process and warns about the others, and `epx info` lists them.
// A CPU test keeps the list equal to the names the sources read and checks each is in README.md.
#pragma once

#include <string>
#include <vector>

namespace epx::detail {

/// The EPX_* variables the library and its tools read, sorted.
const std::vector<std::string>& known_env_names();

/// The EPX_* names set in this process's environment that are not in known_env_names(), sorted.
std::vector<std::string> unknown_env_names();

/// Prints one warning line on stderr for each unknown EPX_* name, the first time it is called in the
/// process (the library calls it wherever it reads its variables; later calls do nothing).
void warn_unknown_env_names_once();

}  // namespace epx::detail
