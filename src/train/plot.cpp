// SVG rendering of metrics.jsonl. Coordinates are computed here (no plotting library), with the
// axis range snapped to nice ticks so every point lies inside its panel.
#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

namespace packmoe::train {

std::vector<double> nice_ticks(double lo, double hi, int target) {
  PACKMOE_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && target >= 1,
                "nice_ticks needs a finite range");
  // One value (or values equal but for rounding, e.g. a smoothed constant): widen so the axis has
  // extent; a range below 1e-9 of the values would need more ticks than doubles can count.
  if (hi - lo <= 1e-9 * std::max(std::abs(lo), std::abs(hi))) {
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  const double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
  const double first = std::floor(lo / step), last = std::ceil(hi / step);
  std::vector<double> ticks;
  for (double t = first; t <= last + 0.5; t += 1) ticks.push_back(t * step);
  return ticks;
}

namespace {

struct Series {
  std::string name, color;
  bool markers = false;
  std::vector<std::pair<double, double>> points;  // (step, value)
  bool dashed = false;
  std::vector<std::pair<double, double>> raw;  // the unsmoothed points, drawn faint (smoothing)
};

// Colours of the runs, in order (the matplotlib "tab10" ones), reused past ten runs.
constexpr const char* kRunColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// TensorBoard's debiased EMA (plot.h PlotOptions::smoothing).
std::vector<std::pair<double, double>> smoothed(const std::vector<std::pair<double, double>>& p,
                                                double w) {
  std::vector<std::pair<double, double>> out;
  double s = 0, weight = 1;
  for (auto [x, y] : p) {
    s = w * s + (1 - w) * y;
    weight *= w;
    out.emplace_back(x, s / (1 - weight));
  }
  return out;
}

struct Box {
  double left, top, width, height;
};

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Tick labels: %g drops float noise such as 0.30000000000000004.
std::string tick_label(double v) { return fmt("%g", std::abs(v) < 1e-12 ? 0.0 : v); }

void draw_panel(std::string& svg, const Box& box, const std::string& y_label,
                const std::vector<Series>& series, double x_lo, double x_hi) {
  const std::vector<double> x_ticks = nice_ticks(x_lo, x_hi, 8);
  double y_lo = INFINITY, y_hi = -INFINITY;
  for (const Series& s : series) {
    for (auto [x, y] : s.points) y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
    for (auto [x, y] : s.raw) y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
  }
  const bool empty = !(y_lo <= y_hi);
  const std::vector<double> y_ticks = empty ? nice_ticks(0, 1, 5) : nice_ticks(y_lo, y_hi, 5);
  const double x0 = x_ticks.front(), x1 = x_ticks.back(), y0 = y_ticks.front(), y1 = y_ticks.back();
  auto px = [&](double x) { return box.left + (x - x0) / (x1 - x0) * box.width; };
  auto py = [&](double y) { return box.top + box.height - (y - y0) / (y1 - y0) * box.height; };
  const double bottom = box.top + box.height, right = box.left + box.width;

  svg += "<g class=\"panel\">\n";
  svg += "<rect x=\"" + fmt("%.2f", box.left) + "\" y=\"" + fmt("%.2f", box.top) + "\" width=\"" +
         fmt("%.2f", box.width) + "\" height=\"" + fmt("%.2f", box.height) +
         "\" fill=\"white\" stroke=\"#444\"/>\n";
  for (double t : x_ticks) {
    const std::string x = fmt("%.2f", px(t));
    svg += "<line x1=\"" + x + "\" y1=\"" + fmt("%.2f", box.top) + "\" x2=\"" + x + "\" y2=\"" +
           fmt("%.2f", bottom) + "\" stroke=\"#e5e5e5\"/>\n";
    svg += "<line x1=\"" + x + "\" y1=\"" + fmt("%.2f", bottom) + "\" x2=\"" + x + "\" y2=\"" +
           fmt("%.2f", bottom + 5) + "\" stroke=\"#444\"/>\n";
    svg += "<text class=\"tick\" x=\"" + x + "\" y=\"" + fmt("%.2f", bottom + 18) +
           "\" text-anchor=\"middle\">" + tick_label(t) + "</text>\n";
  }
  for (double t : y_ticks) {
    const std::string y = fmt("%.2f", py(t));
    svg += "<line x1=\"" + fmt("%.2f", box.left) + "\" y1=\"" + y + "\" x2=\"" +
           fmt("%.2f", right) + "\" y2=\"" + y + "\" stroke=\"#e5e5e5\"/>\n";
    svg += "<line x1=\"" + fmt("%.2f", box.left - 5) + "\" y1=\"" + y + "\" x2=\"" +
           fmt("%.2f", box.left) + "\" y2=\"" + y + "\" stroke=\"#444\"/>\n";
    svg += "<text class=\"tick\" x=\"" + fmt("%.2f", box.left - 8) + "\" y=\"" + y +
           "\" text-anchor=\"end\" dominant-baseline=\"middle\">" + tick_label(t) + "</text>\n";
  }
  svg += "<text class=\"axis-label\" x=\"" + fmt("%.2f", box.left + box.width / 2) + "\" y=\"" +
         fmt("%.2f", bottom + 38) + "\" text-anchor=\"middle\">step</text>\n";
  const std::string ly = fmt("%.2f", box.top + box.height / 2);
  svg += "<text class=\"axis-label\" x=\"" + fmt("%.2f", box.left - 58) + "\" y=\"" + ly +
         "\" text-anchor=\"middle\" transform=\"rotate(-90 " + fmt("%.2f", box.left - 58) + " " +
         ly + ")\">" + escape_xml(y_label) + "</text>\n";
  if (empty) {
    svg += "<text x=\"" + fmt("%.2f", box.left + box.width / 2) + "\" y=\"" + ly +
           "\" text-anchor=\"middle\" fill=\"#888\">no " + escape_xml(y_label) + " data</text>\n";
  }

  auto points_attr = [&](const std::vector<std::pair<double, double>>& p) {
    std::string a;
    for (size_t i = 0; i < p.size(); ++i) {
      if (i) a += ' ';
      a += fmt("%.2f", px(p[i].first)) + "," + fmt("%.2f", py(p[i].second));
    }
    return a;
  };
  for (const Series& s : series)
    if (!s.raw.empty())
      svg += "<polyline class=\"raw\" data-series=\"" + escape_xml(s.name) +
             "\" fill=\"none\" stroke=\"" + s.color +
             "\" stroke-opacity=\"0.25\" stroke-width=\"1\" points=\"" + points_attr(s.raw) +
             "\"/>\n";
  int legend_row = 0;
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    svg += "<polyline class=\"series\" data-series=\"" + escape_xml(s.name) +
           "\" fill=\"none\" stroke=\"" + s.color + "\" stroke-width=\"1.5\"" +
           (s.dashed ? " stroke-dasharray=\"6 3\"" : "") + " points=\"";
    for (size_t i = 0; i < s.points.size(); ++i) {
      if (i) svg += ' ';
      svg += fmt("%.2f", px(s.points[i].first)) + "," + fmt("%.2f", py(s.points[i].second));
    }
    svg += "\"/>\n";
    if (s.markers)
      for (auto [x, y] : s.points)
        svg += "<circle cx=\"" + fmt("%.2f", px(x)) + "\" cy=\"" + fmt("%.2f", py(y)) +
               "\" r=\"3\" fill=\"" + s.color + "\"/>\n";
  }
  // Legend, top right inside the panel, on a backing so curves under it stay readable.
  int entries = 0;
  size_t longest = 0;
  for (const Series& s : series)
    if (!s.points.empty()) ++entries, longest = std::max(longest, s.name.size());
  const double legend_w = 40 + 7.0 * static_cast<double>(longest);  // ~7 px per 12 px character
  if (entries > 0)
    svg += "<rect class=\"legend-box\" x=\"" + fmt("%.2f", right - legend_w - 8) + "\" y=\"" +
           fmt("%.2f", box.top + 6) + "\" width=\"" + fmt("%.2f", legend_w) + "\" height=\"" +
           fmt("%.2f", 18.0 * entries + 4) + "\" fill=\"white\" fill-opacity=\"0.85\" " +
           "stroke=\"#ccc\"/>\n";
  for (const Series& s : series) {
    if (s.points.empty()) continue;
    const double lx = right - legend_w, ly_row = box.top + 16 + 18 * legend_row++;
    svg += "<line x1=\"" + fmt("%.2f", lx) + "\" y1=\"" + fmt("%.2f", ly_row) + "\" x2=\"" +
           fmt("%.2f", lx + 24) + "\" y2=\"" + fmt("%.2f", ly_row) + "\" stroke=\"" + s.color +
           "\" stroke-width=\"2\"" + (s.dashed ? " stroke-dasharray=\"6 3\"" : "") + "/>\n";
    svg += "<text class=\"legend\" x=\"" + fmt("%.2f", lx + 30) + "\" y=\"" + fmt("%.2f", ly_row) +
           "\" dominant-baseline=\"middle\">" + escape_xml(s.name) + "</text>\n";
  }
  svg += "</g>\n";
}

}  // namespace

Result<std::string> render_metrics_svg(const std::vector<PlotRun>& runs, const PlotOptions& o) {
  if (!(o.smoothing >= 0 && o.smoothing < 1))
    return Status::error("smoothing = " + fmt("%g", o.smoothing) + " must be in [0, 1)");
  std::vector<Series> loss, grad, lr;
  double x_lo = INFINITY, x_hi = -INFINITY;
  bool any_loss = false, any_record = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    // A resumed run may repeat steps; sort by step (stably) so each polyline runs left to right.
    std::vector<MetricsRecord> records = runs[i].records;
    std::stable_sort(records.begin(), records.end(), [](const MetricsRecord& a,
                                                        const MetricsRecord& b) {
      return a.step < b.step;
    });
    any_record |= !records.empty();
    const std::string color = kRunColors[i % std::size(kRunColors)];
    const std::string prefix = runs.size() > 1 && !runs[i].name.empty() ? runs[i].name + ": " : "";
    Series train{prefix + "train loss", color, false, {}, false, {}};
    Series eval{prefix + "eval loss", color, true, {}, false, {}};
    eval.dashed = runs.size() > 1;  // one run: eval in its own colour, several: dashed
    if (runs.size() == 1) eval.color = "#ff7f0e";
    Series g{prefix + "train grad norm", runs.size() == 1 ? "#2ca02c" : color, false, {}, false, {}};
    Series l{prefix + "learning rate", runs.size() == 1 ? "#9467bd" : color, false, {}, false, {}};
    for (const MetricsRecord& r : records) {
      const double step = static_cast<double>(r.step);
      if (std::isfinite(r.loss)) {
        (r.split == Split::kTrain ? train : eval).points.emplace_back(step, r.loss);
        x_lo = std::min(x_lo, step), x_hi = std::max(x_hi, step);
      }
      if (r.split == Split::kTrain && r.grad_norm && std::isfinite(*r.grad_norm)) {
        g.points.emplace_back(step, *r.grad_norm);
        x_lo = std::min(x_lo, step), x_hi = std::max(x_hi, step);
      }
      if (r.split == Split::kTrain && std::isfinite(r.lr)) l.points.emplace_back(step, r.lr);
    }
    any_loss |= !train.points.empty() || !eval.points.empty();
    if (o.smoothing > 0)
      for (Series* s : {&train, &g}) {
        s->raw = s->points;
        s->points = smoothed(s->raw, o.smoothing);
      }
    loss.push_back(train);
    loss.push_back(eval);
    grad.push_back(g);
    lr.push_back(l);
  }
  if (!any_loss)
    return Status::error(any_record ? "no finite loss values (nothing to plot)"
                                    : "no metrics records (nothing to plot)");

  constexpr double kWidth = 900, kHeight = 960;
  std::string svg;
  svg += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"900\" height=\"960\" viewBox=\"0 0 " +
         fmt("%.0f", kWidth) + " " + fmt("%.0f", kHeight) +
         "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  svg += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg += "<text class=\"title\" x=\"450\" y=\"26\" text-anchor=\"middle\" font-size=\"16\">" +
         escape_xml(o.title) + "</text>\n";
  if (o.smoothing > 0)
    svg += "<text class=\"subtitle\" x=\"450\" y=\"42\" text-anchor=\"middle\" fill=\"#666\">"
           "train curves smoothed: EMA " + fmt("%g", o.smoothing) + " (raw faint)</text>\n";
  draw_panel(svg, Box{90, 56, 780, 240}, "loss", loss, x_lo, x_hi);
  draw_panel(svg, Box{90, 366, 780, 220}, "grad norm", grad, x_lo, x_hi);
  draw_panel(svg, Box{90, 656, 780, 220}, "learning rate", lr, x_lo, x_hi);
  svg += "</svg>\n";
  return svg;
}

Result<std::string> render_metrics_svg(const std::vector<MetricsRecord>& records,
                                       const std::string& title) {
  return render_metrics_svg({PlotRun{"", records}}, PlotOptions{title, 0});
}

std::string run_name_of(const std::string& metrics_path) {
  const std::filesystem::path p = std::filesystem::path(metrics_path).lexically_normal();
  const std::string dir = p.parent_path().filename().string();
  return dir.empty() || dir == "." || dir == ".." ? p.stem().string() : dir;
}

Status plot_metrics_files(const std::vector<std::string>& paths, std::vector<std::string> names,
                          PlotOptions options, const std::string& svg_path) {
  if (paths.empty()) return Status::error("no metrics file to plot");
  if (!names.empty() && names.size() != paths.size())
    return Status::error(std::to_string(names.size()) + " --name for " +
                         std::to_string(paths.size()) + " metrics files: give one per file");
  if (names.empty())
    for (const std::string& p : paths) names.push_back(run_name_of(p));
  std::vector<PlotRun> runs;
  for (size_t i = 0; i < paths.size(); ++i) {
    Result<std::vector<MetricsRecord>> records = read_metrics(paths[i]);
    if (!records) return records.status();
    runs.push_back({names[i], std::move(records.value())});
  }
  if (options.title.empty()) {
    options.title = "packmoe:";
    for (size_t i = 0; i < names.size(); ++i) options.title += (i ? ", " : " ") + names[i];
  }
  Result<std::string> svg = render_metrics_svg(runs, options);
  if (!svg) return Status::error((paths.size() == 1 ? paths[0] + ": " : std::string()) +
                                 svg.status().message());
  return write_file_atomically(svg_path, svg.value());
}

Status plot_metrics_file(const std::string& metrics_path, const std::string& svg_path) {
  return plot_metrics_files({metrics_path}, {run_name_of(metrics_path)}, PlotOptions{}, svg_path);
}

}  // namespace packmoe::train
