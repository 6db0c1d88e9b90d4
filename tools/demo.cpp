#include "tools/commands.h"
namespace epx::tools {
int run_demo(const std::vector<std::string>&) { return 0; }
}
