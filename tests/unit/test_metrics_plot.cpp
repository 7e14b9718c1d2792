// Tests of train/metrics and train/plot: the JSONL round trip (NaN included), the exact text of
// the Megatron-style log line and of the progress bar, the SVG's structure (well-formed, one
// polyline per series with one point per finite value, axis labels), and `packmoe plot` errors as
// a user sees them (via the binary in $PACKMOE_CLI, as test_cli.cpp does).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "common/run_cli.h"
#include "train/metrics.h"
#include "train/plot.h"

namespace packmoe::train {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  fs::path base = env ? fs::path(env) : fs::temp_directory_path();
  fs::path dir = base / ("metrics_plot_" + std::to_string(::getpid()) + "_" +
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

MetricsRecord train_record(int64_t step, double loss, double grad_norm) {
  MetricsRecord r;
  r.step = step;
  r.split = Split::kTrain;
  r.loss = loss;
  r.lr = 3e-4;
  r.grad_norm = grad_norm;
  r.tokens_per_s = 1000;
  r.elapsed_s = 0.5 * static_cast<double>(step);
  return r;
}

MetricsRecord eval_record(int64_t step, double loss) {
  MetricsRecord r = train_record(step, loss, 0);
  r.split = Split::kEval;
  r.grad_norm.reset();
  return r;
}

TEST(Metrics, JsonLineText) {
  MetricsRecord r = train_record(10, 5.5, 1.25);
  EXPECT_EQ(metrics_record_to_json_line(r),
            R"({"step":10,"split":"train","loss":5.5,"lr":0.0003,"grad_norm":1.25,)"
            R"("tokens_per_s":1000.0,"elapsed_s":5.0})");
  r.tflops = 412.5;
  r.mfu = 0.5;
  r.loss = std::nan("");
  EXPECT_EQ(metrics_record_to_json_line(r),
            R"({"step":10,"split":"train","loss":null,"lr":0.0003,"grad_norm":1.25,)"
            R"("tokens_per_s":1000.0,"tflops":412.5,"mfu":0.5,"elapsed_s":5.0})");
}

TEST(Metrics, JsonlRoundTrip) {
  fs::path path = temp_dir() / "metrics.jsonl";
  std::vector<MetricsRecord> written = {train_record(1, 5.25, 2.5), eval_record(1, 5.125),
                                        train_record(2, std::nan(""), 1e30)};
  written[0].tflops = 123.25;
  written[0].mfu = 0.125;
  {
    Result<MetricsWriter> w = MetricsWriter::open(path.string(), /*append=*/false);
    ASSERT_TRUE(w.is_ok()) << w.status().message();
    ASSERT_TRUE(w.value().write(written[0]).is_ok());
    // Flushed per line: a reader sees the line while the writer is still open.
    EXPECT_EQ(read_metrics(path.string()).value().size(), 1u);
  }
  {  // a resumed run appends
    Result<MetricsWriter> w = MetricsWriter::open(path.string(), /*append=*/true);
    ASSERT_TRUE(w.is_ok());
    ASSERT_TRUE(w.value().write(written[1]).is_ok());
    ASSERT_TRUE(w.value().write(written[2]).is_ok());
  }
  Result<std::vector<MetricsRecord>> read = read_metrics(path.string());
  ASSERT_TRUE(read.is_ok()) << read.status().message();
  ASSERT_EQ(read.value().size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const MetricsRecord &a = written[i], &b = read.value()[i];
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.split, b.split);
    if (std::isnan(a.loss)) {
      EXPECT_TRUE(std::isnan(b.loss));
    } else {
      EXPECT_EQ(a.loss, b.loss);
    }
    EXPECT_EQ(a.lr, b.lr);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
    EXPECT_EQ(a.tokens_per_s, b.tokens_per_s);
    EXPECT_EQ(a.tflops, b.tflops);
    EXPECT_EQ(a.mfu, b.mfu);
    EXPECT_EQ(a.elapsed_s, b.elapsed_s);
  }
  // Truncating open starts over.
  { ASSERT_TRUE(MetricsWriter::open(path.string(), false).is_ok()); }
  EXPECT_TRUE(read_metrics(path.string()).value().empty());
}

TEST(Metrics, MalformedLinesNameTheLine) {
  fs::path path = temp_dir() / "m.jsonl";
  const std::string good = metrics_record_to_json_line(train_record(1, 2, 3));
  auto error_for = [&](const std::string& bad) {
    std::ofstream(path) << good << "\n\n" << bad << "\n";
    Result<std::vector<MetricsRecord>> r = read_metrics(path.string());
    return r.is_ok() ? std::string("(no error)") : r.status().message();
  };
  const std::string prefix = path.string() + ":3: malformed metrics line: ";
  EXPECT_EQ(error_for("{\"step\": 2"), prefix + "not valid JSON");
  EXPECT_EQ(error_for("[1]"), prefix + "not a JSON object");
  EXPECT_EQ(error_for(R"({"split":"train"})"), prefix + "missing field 'step'");
  EXPECT_EQ(error_for(R"({"step":1.5})"), prefix + "field 'step' must be an integer");
  EXPECT_EQ(error_for(R"({"step":2,"split":"test"})"),
            prefix + "field 'split' must be \"train\" or \"eval\" (got \"test\")");
  EXPECT_EQ(error_for(R"({"step":2,"split":"eval","lr":0,"tokens_per_s":0,"elapsed_s":0})"),
            prefix + "missing field 'loss'");
  EXPECT_EQ(
      error_for(R"({"step":2,"split":"eval","loss":"x","lr":0,"tokens_per_s":0,"elapsed_s":0})"),
      prefix + "field 'loss' must be a number (got string)");
  EXPECT_EQ(error_for(good), "(no error)");
  EXPECT_EQ(read_metrics((path.parent_path() / "none.jsonl").string()).status().message(),
            "cannot open metrics file '" + (path.parent_path() / "none.jsonl").string() +
                "': No such file or directory");
}

TEST(Metrics, MegatronLogLine) {
  LogLine l;
  l.iteration = 10;
  l.total_iterations = 100;
  l.consumed_samples = 640;
  l.ms_per_iteration = 812.34;
  l.learning_rate = 3e-4;
  l.lm_loss = 5.123456;
  l.load_balancing_loss = 1.0123;
  l.grad_norm = 1.2344;
  l.tokens_per_s = 12345.6;
  l.peak_memory_gb = 61.25;
  l.eta_s = 83.9;
  EXPECT_EQ(format_log_line(l),
            " iteration       10/     100 | consumed samples:          640 |"
            " elapsed time per iteration (ms): 812.3 | learning rate: 3.000000E-04 |"
            " lm loss: 5.123456E+00 | load_balancing_loss: 1.01 | grad norm: 1.234 |"
            " tokens/s: 12346 | peak memory (GB): 61.2 | ETA 1:23 |");
  LogLine m;
  m.iteration = 12345678;
  m.total_iterations = 99999999;
  m.consumed_samples = 123456789012;
  m.ms_per_iteration = 0.04;
  m.tflops_per_gpu = 412.46;
  m.learning_rate = 0;
  m.lm_loss = 10.5;
  m.tokens_per_s = 0;
  EXPECT_EQ(format_log_line(m),
            " iteration 12345678/99999999 | consumed samples: 123456789012 |"
            " elapsed time per iteration (ms): 0.0 | throughput per GPU (TFLOP/s/GPU): 412.5 |"
            " learning rate: 0.000000E+00 | lm loss: 1.050000E+01 | tokens/s: 0 |");
}

TEST(Metrics, Durations) {
  EXPECT_EQ(format_duration(0), "0:00");
  EXPECT_EQ(format_duration(59.99), "0:59");
  EXPECT_EQ(format_duration(83.9), "1:23");
  EXPECT_EQ(format_duration(3599), "59:59");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(100 * 3600.0), "100:00:00");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(std::nan("")), "?");
  EXPECT_EQ(format_duration(INFINITY), "?");
}

TEST(Metrics, ProgressBar) {
  EXPECT_EQ(progress_bar(30, 100, 12.0),
            "[=========>                    ]  30/100  30% 0:12<0:28 2.50 it/s");
  EXPECT_EQ(progress_bar(0, 100, 0.0),
            "[>                             ]   0/100   0% 0:00<? ? it/s");
  EXPECT_EQ(progress_bar(100, 100, 40.0),
            "[==============================] 100/100 100% 0:40<0:00 2.50 it/s");
  EXPECT_EQ(progress_bar(3, 7, 6.0, 10), "[====>     ] 3/7  42% 0:06<0:08 0.50 it/s");
  // Out-of-range steps are clamped, not drawn past the bar.
  EXPECT_EQ(progress_bar(9, 7, 6.0, 10), progress_bar(7, 7, 6.0, 10));
  // Same width every step, so redrawing with '\r' leaves no stale characters.
  for (int64_t s = 1; s <= 100; ++s)
    EXPECT_EQ(progress_bar(s, 100, 1.0 + s).size(), progress_bar(1, 100, 2.0).size());
}

TEST(Plot, NiceTicks) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(1.13, 5.87, 5), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(nice_ticks(0, 1000, 8),
            (std::vector<double>{0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000}));
  for (auto [lo, hi] : std::vector<std::pair<double, double>>{
           {3, 3}, {0, 0}, {-7.5, 0.2}, {1e-5, 3e-5}, {2.1, 2.9e6}}) {
    std::vector<double> t = nice_ticks(lo, hi, 5);
    EXPECT_LE(t.front(), lo);
    EXPECT_GE(t.back(), hi);
    EXPECT_GE(t.size(), 3u);
    EXPECT_LE(t.size(), 12u);
  }
}

// Checks that every tag is closed in order (no XML library in the build); returns "" if so.
std::string xml_problem(const std::string& s) {
  std::vector<std::string> stack;
  size_t pos = 0;
  while ((pos = s.find('<', pos)) != std::string::npos) {
    size_t end = s.find('>', pos);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(pos);
    std::string tag = s.substr(pos + 1, end - pos - 1);
    pos = end + 1;
    if (tag.empty()) return "empty tag";
    if (tag[0] == '?') continue;
    if (tag[0] == '/') {
      if (stack.empty() || stack.back() != tag.substr(1)) return "unbalanced </" + tag + ">";
      stack.pop_back();
      continue;
    }
    if (tag.back() == '/') continue;
    stack.push_back(tag.substr(0, tag.find(' ')));
  }
  return stack.empty() ? "" : "unclosed <" + stack.back() + ">";
}

struct Polyline {
  std::string series;
  std::vector<std::pair<double, double>> points;
};

std::vector<Polyline> polylines(const std::string& svg) {
  std::vector<Polyline> out;
  size_t pos = 0;
  while ((pos = svg.find("<polyline", pos)) != std::string::npos) {
    size_t end = svg.find("/>", pos);
    std::string tag = svg.substr(pos, end - pos);
    pos = end;
    Polyline p;
    size_t s = tag.find("data-series=\"") + 13;
    p.series = tag.substr(s, tag.find('"', s) - s);
    size_t q = tag.find("points=\"") + 8;
    std::istringstream points(tag.substr(q, tag.find('"', q) - q));
    std::string xy;
    while (points >> xy) {
      size_t comma = xy.find(',');
      p.points.emplace_back(std::stod(xy.substr(0, comma)), std::stod(xy.substr(comma + 1)));
    }
    out.push_back(p);
  }
  return out;
}

TEST(Plot, SvgHasOnePolylinePerSeries) {
  std::vector<MetricsRecord> records;
  for (int s = 1; s <= 10; ++s)
    records.push_back(train_record(s, s == 7 ? std::nan("") : 6.0 - 0.3 * s, 1.0 + 0.1 * s));
  records.push_back(eval_record(5, 4.6));
  records.push_back(eval_record(10, 3.4));
  Result<std::string> r = render_metrics_svg(records, "run <a & b>");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const std::string& svg = r.value();
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("run &lt;a &amp; b&gt;"), std::string::npos);  // title, escaped
  EXPECT_EQ(svg.find("<script"), std::string::npos);                // self-contained, inert
  EXPECT_EQ(svg.find("href"), std::string::npos);

  std::vector<Polyline> lines = polylines(svg);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].series, "train loss");
  EXPECT_EQ(lines[0].points.size(), 9u);  // the NaN at step 7 is skipped
  EXPECT_EQ(lines[1].series, "eval loss");
  EXPECT_EQ(lines[1].points.size(), 2u);
  EXPECT_EQ(lines[2].series, "train grad norm");
  EXPECT_EQ(lines[2].points.size(), 10u);
  for (const Polyline& p : lines) {
    for (size_t i = 0; i < p.points.size(); ++i) {
      EXPECT_GE(p.points[i].first, 90.0);
      EXPECT_LE(p.points[i].first, 870.0);
      if (i) {
        EXPECT_GT(p.points[i].first, p.points[i - 1].first);  // sorted by step
      }
    }
  }
  // Loss falls, so its y (downwards in SVG) grows; both panels share the x scale.
  EXPECT_LT(lines[0].points.front().second, lines[0].points.back().second);
  EXPECT_EQ(lines[0].points.front().first, lines[2].points.front().first);
  // Axis labels and legends.
  EXPECT_NE(svg.find(">step</text>"), std::string::npos);
  EXPECT_NE(svg.find(">loss</text>"), std::string::npos);
  EXPECT_NE(svg.find(">grad norm</text>"), std::string::npos);
  EXPECT_NE(svg.find("class=\"legend\""), std::string::npos);
  EXPECT_NE(svg.find(">eval loss</text>"), std::string::npos);
  EXPECT_NE(svg.find("class=\"tick\""), std::string::npos);
}

TEST(Plot, NoGradNormAndNoData) {
  Result<std::string> only_eval = render_metrics_svg({eval_record(3, 2.0)}, "t");
  ASSERT_TRUE(only_eval.is_ok());
  EXPECT_EQ(polylines(only_eval.value()).size(), 1u);
  EXPECT_NE(only_eval.value().find("no grad norm data"), std::string::npos);
  EXPECT_EQ(xml_problem(only_eval.value()), "");
  EXPECT_EQ(render_metrics_svg({}, "t").status().message(), "no metrics records (nothing to plot)");
  EXPECT_EQ(render_metrics_svg({train_record(1, std::nan(""), 1)}, "t").status().message(),
            "no finite loss values (nothing to plot)");
}

using packmoe::test::RunResult;
using packmoe::test::run_cli;

TEST(PlotCli, WritesSvg) {
  fs::path dir = temp_dir();
  fs::path metrics = dir / "metrics.jsonl", svg = dir / "curves.svg";
  {
    MetricsWriter w = MetricsWriter::open(metrics.string(), false).value();
    for (int s = 1; s <= 20; ++s) ASSERT_TRUE(w.write(train_record(s, 5.0 / s, 0.5)).is_ok());
    ASSERT_TRUE(w.write(eval_record(20, 0.3)).is_ok());
  }
  RunResult r = run_cli("plot " + metrics.string() + " --out " + svg.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "wrote " + svg.string() + "\n");
  std::string text = read_text(svg);
  EXPECT_EQ(xml_problem(text), "");
  std::vector<Polyline> lines = polylines(text);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].points.size(), 20u);
  EXPECT_NE(text.find("packmoe training: metrics.jsonl"), std::string::npos);
  for (const auto& e : fs::directory_iterator(dir))  // nothing but the input and the plot
    EXPECT_TRUE(e.path() == metrics || e.path() == svg) << e.path();
}

TEST(PlotCli, Help) {
  RunResult r = run_cli("plot --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("SVG"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--out"), std::string::npos);
  EXPECT_NE(r.output.find("grad norm"), std::string::npos);
  EXPECT_NE(run_cli("--help").output.find("plot"), std::string::npos);
}

TEST(PlotCli, OneLineErrorsAndNoOutputOnFailure) {
  fs::path dir = temp_dir();
  fs::path svg = dir / "out.svg";
  std::ofstream(svg) << "previous plot";  // a failed run must not clobber it
  auto expect_error = [&](const fs::path& metrics, const std::string& message) {
    RunResult r = run_cli("plot " + metrics.string() + " --out " + svg.string());
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(r.output, "packmoe: error: " + message + "\n");
    EXPECT_EQ(read_text(svg), "previous plot");
  };
  expect_error(dir / "missing.jsonl", "cannot open metrics file '" +
                                          (dir / "missing.jsonl").string() +
                                          "': No such file or directory");
  fs::path bad = dir / "bad.jsonl";
  std::ofstream(bad) << metrics_record_to_json_line(train_record(1, 2, 3)) << "\n"
                     << metrics_record_to_json_line(train_record(2, 2, 3)) << "\n"
                     << "{\"step\": 3, \"split\": \"train\", \"loss\n";
  expect_error(bad, bad.string() + ":3: malformed metrics line: not valid JSON");
  fs::path empty = dir / "empty.jsonl";
  std::ofstream(empty) << "\n";
  expect_error(empty, empty.string() + ": no metrics records (nothing to plot)");

  RunResult no_arg = run_cli("plot");
  EXPECT_NE(no_arg.exit_code, 0);
  EXPECT_NE(no_arg.output.find("metrics"), std::string::npos) << no_arg.output;
}

}  // namespace
}  // namespace packmoe::train
