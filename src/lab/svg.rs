//! The replay as a chart: admitted per 100 ms for each algorithm on one time axis, one panel
//! per rule, with the rule's limit marked as its average per 100 ms (and its burst when it
//! was chosen), and for a rule replayed with its delay a panel of the wait each admitted
//! request paid, by arrival. A token replay is drawn as the tokens spent so far, beside the
//! bucket and the rate since the first call. Drawn with plotters' SVG backend, text as SVG
//! text (no font files).

use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::LabError;
use super::replay::{Algorithm, BIN_NS, Report, RuleReport};
use crate::limiter::gcra::NANOS_PER_SEC;

/// Most points per line; longer traces are drawn with wider bins.
const MAX_BINS: u64 = 4_000;

fn colour(a: Algorithm) -> RGBColor {
    match a {
        Algorithm::Gcra => RGBColor(0, 114, 178),
        Algorithm::FixedWindow => RGBColor(213, 94, 0),
        Algorithm::SlidingLog => RGBColor(0, 158, 115),
        Algorithm::SlidingWindow => RGBColor(204, 121, 167),
        Algorithm::GcraDelay => RGBColor(230, 159, 0),
    }
}

/// Draws `report` into the SVG file `path`, titled `title`.
///
/// # Errors
///
/// [`LabError::Svg`] when there is nothing to draw or the file cannot be written.
pub fn draw(report: &Report, path: &Path, title: &str) -> Result<(), LabError> {
    if report.tokens {
        return draw_tokens(report, path, title);
    }
    let err = |e: &dyn std::fmt::Display| LabError::Svg(format!("{}: {e}", path.display()));
    let bins = || {
        report
            .rules
            .iter()
            .flat_map(|r| {
                Algorithm::EVERY
                    .into_iter()
                    .filter_map(|a| r.algorithms.get(a))
            })
            .flat_map(|t| t.bins.keys().copied())
    };
    let (Some(first), Some(last)) = (bins().min(), bins().max()) else {
        return Err(err(&"nothing was admitted, so there is nothing to draw"));
    };
    // Bins of `width` × 100 ms, so that a line has at most MAX_BINS points.
    let width = (last - first + 1).div_ceil(MAX_BINS).max(1);
    // One empty bin either side, so the first rise and the last fall show.
    let (first, last) = ((first / width).saturating_sub(1), last / width + 1);
    let bin_ns = BIN_NS * width;
    let secs = |bin: u64| (bin * bin_ns) as f64 / NANOS_PER_SEC as f64;
    let (x0, x1) = (secs(first), secs(last + 1));
    let per = if width == 1 {
        "100 ms".to_string()
    } else {
        format!("{} ms", bin_ns / 1_000_000)
    };

    // The rules replayed with their delay that held some request: a panel of waits each.
    let waited: Vec<(&RuleReport, Algorithm)> = report
        .rules
        .iter()
        .filter_map(|r| {
            Algorithm::EVERY
                .into_iter()
                .find(|&a| r.algorithms.get(a).is_some_and(|t| !t.wait_bins.is_empty()))
                .map(|a| (r, a))
        })
        .collect();
    let panels = report.rules.len() + waited.len();
    let height = u32::try_from(60 + 300 * panels).unwrap_or(u32::MAX);
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    let areas = root.split_evenly((panels, 1));
    for ((rule, a), area) in waited.iter().zip(&areas[report.rules.len()..]) {
        draw_waits(rule, *a, area, (x0, x1), per.as_str()).map_err(|e| err(&e))?;
    }
    for (rule, area) in report.rules.iter().zip(areas) {
        let lines: Vec<(Algorithm, Vec<(f64, f64)>)> = Algorithm::EVERY
            .into_iter()
            .filter_map(|a| {
                let tally = rule.algorithms.get(a)?;
                let mut dense = vec![0u64; usize::try_from(last - first + 1).unwrap_or(0)];
                for (&bin, &n) in &tally.bins {
                    if let Some(slot) = usize::try_from(bin / width - first)
                        .ok()
                        .and_then(|i| dense.get_mut(i))
                    {
                        *slot += n;
                    }
                }
                // Steps: each bin flat from its start to its end.
                let points = dense
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &n)| {
                        let b = first + i as u64;
                        [(secs(b), n as f64), (secs(b + 1), n as f64)]
                    })
                    .collect();
                Some((a, points))
            })
            .collect();
        let limit = f64::from(rule.limit) * bin_ns as f64
            / (rule.period_seconds.max(1) * NANOS_PER_SEC) as f64;
        let top = lines
            .iter()
            .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
            .fold(limit, f64::max)
            .max(1.0)
            * 1.12;
        let caption = caption(rule, "");
        let mut chart = ChartBuilder::on(&area)
            .caption(caption, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(x0..x1, 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc(format!("admitted per {per}"))
            .light_line_style(RGBColor(238, 238, 238))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .x_label_formatter(&|x| time_label(*x, x1 - x0))
            .draw()
            .map_err(|e| err(&e))?;
        boundaries(&mut chart, rule.period_seconds, (x0, x1), top).map_err(|e| err(&e))?;
        // Thickest first, GCRA last and thinnest, so lines that coincide stay visible as bands.
        let order = [
            (Algorithm::FixedWindow, 8),
            (Algorithm::SlidingLog, 5),
            (Algorithm::SlidingWindow, 3),
            (Algorithm::Gcra, 2),
            (Algorithm::GcraDelay, 2),
        ];
        for (a, w) in order {
            let Some((_, points)) = lines.iter().find(|(b, _)| *b == a) else {
                continue;
            };
            let c = colour(a);
            chart
                .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(w)))
                .map_err(|e| err(&e))?
                .label(a.name())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(w)));
        }
        let label = format!("limit: {} per {per} on average", round(limit));
        reference(
            &mut chart,
            [(x0, limit), (x1, limit)],
            label,
            SeriesLabelPosition::MiddleRight,
        )
        .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The panel of the waits `rule`'s requests paid under `a`: the longest wait of the requests
/// arriving in each 100 ms, beside the rule's delay.
fn draw_waits(
    rule: &RuleReport,
    a: Algorithm,
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    (x0, x1): (f64, f64),
    per: &str,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let Some(tally) = rule.algorithms.get(a) else {
        return Ok(());
    };
    let ms = |ns: u64| ns as f64 / 1_000_000.0;
    let secs = |bin: u64| (bin * BIN_NS) as f64 / NANOS_PER_SEC as f64;
    let delay = ms(rule.delay_ns);
    let top = tally
        .wait_bins
        .values()
        .map(|&w| ms(w))
        .fold(delay, f64::max)
        .max(1.0)
        * 1.12;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "{}: the wait paid by each admitted request, the longest per {per} of arrival",
                rule.path
            ),
            ("sans-serif", 17),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("arrival time (s)")
        .y_desc("wait (ms)")
        .light_line_style(RGBColor(238, 238, 238))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_label_formatter(&|x| time_label(*x, x1 - x0))
        .draw()?;
    let c = colour(a);
    let points: Vec<(f64, f64)> = tally
        .wait_bins
        .iter()
        .flat_map(|(&bin, &w)| [(secs(bin), ms(w)), (secs(bin + 1), ms(w))])
        .collect();
    chart
        .draw_series(LineSeries::new(points, c.stroke_width(2)))?
        .label(format!("{}: longest wait", a.name()))
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
    reference(
        &mut chart,
        [(x0, delay), (x1, delay)],
        format!("delay: {} ms, the longest a request is held", round(delay)),
        SeriesLabelPosition::LowerRight,
    )
}

/// A panel's caption: the rule, its rate (of `what`), its burst and its delay.
fn caption(rule: &RuleReport, what: &str) -> String {
    let delay = if rule.delay_ns > 0 {
        format!(", delay {} ms", rule.delay_ns / 1_000_000)
    } else {
        String::new()
    };
    format!(
        "{}{}: {} {what}per {} s, burst {} ({}){delay}",
        rule.path,
        if rule.name.is_empty() {
            String::new()
        } else {
            format!(" ({})", rule.name)
        },
        rule.limit,
        rule.period_seconds,
        rule.burst,
        if rule.burst_set { "set" } else { "inherited" }
    )
}

/// The window boundaries (multiples of the period) a fixed window resets at, dashed, the first
/// one in the legend.
fn boundaries(
    chart: &mut ChartContext<'_, SVGBackend<'_>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    period_seconds: u64,
    (x0, x1): (f64, f64),
    top: f64,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    let period = period_seconds.max(1) as f64;
    let at = ((x0 / period).ceil() as u64..=(x1 / period).floor() as u64)
        .map(|k| k as f64 * period)
        .take(200);
    for (i, b) in at.enumerate() {
        let series = chart.draw_series(DashedLineSeries::new(
            [(b, 0.0), (b, top)],
            3,
            3,
            RGBColor(150, 150, 150).stroke_width(1),
        ))?;
        if i == 0 {
            series
                .label("window boundary")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RGBColor(150, 150, 150)));
        }
    }
    Ok(())
}

/// What a panel is read against, dashed and labelled `label`, then the legend at `position`.
fn reference<'a, 'b: 'a>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    line: [(f64, f64); 2],
    label: String,
    position: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>> {
    chart
        .draw_series(DashedLineSeries::new(line, 6, 4, BLACK.stroke_width(1)))?
        .label(label)
        .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK));
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .label_font(("sans-serif", 13))
        .draw()
}

/// A line of (time, total so far) points.
type Steps = Vec<(f64, f64)>;

/// A token replay: per rule, each algorithm's tokens spent so far, and `B + R·t` from the first
/// call, what GCRA holds spend to but for the calls in flight. What was refused is in the
/// printed table: drawn beside the spend, its larger numbers would flatten the lines that matter.
fn draw_tokens(report: &Report, path: &Path, title: &str) -> Result<(), LabError> {
    let err = |e: &dyn std::fmt::Display| LabError::Svg(format!("{}: {e}", path.display()));
    let tallies = || {
        report.rules.iter().flat_map(|r| {
            Algorithm::EVERY
                .into_iter()
                .filter_map(|a| r.algorithms.get(a))
        })
    };
    let bins = || tallies().flat_map(|t| t.bins.keys().copied());
    let (Some(first), Some(last)) = (bins().min(), bins().max()) else {
        return Err(err(&"nothing was offered, so there is nothing to draw"));
    };
    let secs = |bin: u64| (bin * BIN_NS) as f64 / NANOS_PER_SEC as f64;
    let (x0, x1) = (secs(first), secs(last + 1));
    let panels = report.rules.len();
    let height = u32::try_from(60 + 340 * panels).unwrap_or(u32::MAX);
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| err(&e))?;
    for (rule, area) in report.rules.iter().zip(root.split_evenly((panels, 1))) {
        // (algorithm, spent so far), as steps at each bin's end.
        let cumulative = |bins: &std::collections::BTreeMap<u64, u64>| {
            let mut total = 0u64;
            let mut points = vec![(x0, 0.0)];
            for (&bin, &n) in bins {
                points.push((secs(bin), total as f64));
                total += n;
                points.push((secs(bin), total as f64));
            }
            points.push((x1, total as f64));
            points
        };
        let lines: Vec<(Algorithm, Steps)> = Algorithm::EVERY
            .into_iter()
            .filter_map(|a| Some((a, cumulative(&rule.algorithms.get(a)?.bins))))
            .collect();
        let rate = f64::from(rule.limit) / rule.period_seconds.max(1) as f64;
        let budget = |x: f64| f64::from(rule.burst) + rate * (x - x0);
        let top = lines
            .iter()
            .flat_map(|(_, s)| s.iter().map(|(_, y)| *y))
            .fold(budget(x1), f64::max)
            * 1.08;
        let caption = caption(rule, "tokens ");
        let mut chart = ChartBuilder::on(&area)
            .caption(caption, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("tokens spent so far")
            .light_line_style(RGBColor(238, 238, 238))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(|e| err(&e))?;
        boundaries(&mut chart, rule.period_seconds, (x0, x1), top).map_err(|e| err(&e))?;
        for (a, spent) in &lines {
            let c = colour(*a);
            chart
                .draw_series(LineSeries::new(spent.iter().copied(), c.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(format!("{}: spent", a.name()))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
        }
        reference(
            &mut chart,
            [(x0, budget(x0)), (x1, budget(x1))],
            "the bucket and the rate since the first call".into(),
            SeriesLabelPosition::UpperLeft,
        )
        .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// A time axis label: whole seconds on an axis longer than 10 s, tenths otherwise.
fn time_label(x: f64, span: f64) -> String {
    if span > 10.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

fn round(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}
