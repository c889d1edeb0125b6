// hstu_loadgen's stop signals (client/stop_signal.h), in child processes (gtest death tests): a
// signal delivered twice at once is one stop; a second one later ends the process by the signal.
// raise() runs the handler before it returns, so each signal is handled on its own (two kill()s
// from outside may merge into one pending signal and prove nothing).

#include "client/stop_signal.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

namespace hstu::loadgen {
namespace {

TEST(StopSignalDeathTest, TheSameStopTwiceIsOneStop) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InstallStopSignals();
        if (Interrupted()) _exit(3);
        raise(SIGTERM);
        raise(SIGTERM);  // as timeout(1) sends it: to the process, then to its group
        raise(SIGINT);
        _exit(Interrupted() ? 0 : 4);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(StopSignalDeathTest, ASecondStopLaterEndsTheProcessAtOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        InstallStopSignals();
        raise(SIGTERM);
        usleep(static_cast<useconds_t>(kSameStopNanoseconds / 1000 + 50'000));
        raise(SIGTERM);
        _exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGTERM), "");
}

}  // namespace
}  // namespace hstu::loadgen
