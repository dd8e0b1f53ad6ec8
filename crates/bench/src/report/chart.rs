//! The report's SVG chart: per graph, `auto`'s speedup over each peer, drawn with plotters.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{ChartData, ChartSeries, ReportData};
use crate::error::{Error, Result};

/// Bar colours of the chart, one per algorithm.
const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
    RGBColor(173, 73, 74),
];

fn plot_err<E: std::fmt::Display>(e: E) -> Error {
    Error::new(format!("drawing the chart: {e}"))
}

/// The SVG chart: per graph, `auto`'s speedup over each peer (geo-mean over the graph's shapes
/// and dtypes), with a line at 1×. Without such data, an SVG that says so.
///
/// # Errors
/// Drawing failures.
pub fn chart_svg(data: &ReportData<'_>) -> Result<String> {
    let ChartData { graphs, series } = data.chart_series();
    let n = graphs.len();
    let width = (200 + 60 * n * series.len().max(1)).clamp(640, 1600) as u32;
    let height = 520u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        if n == 0 || series.is_empty() {
            let style = TextStyle::from(("sans-serif", 18).into_font())
                .pos(Pos::new(HPos::Center, VPos::Center));
            root.draw(&Text::new(
                "no peer timings of auto in these runs".to_string(),
                (width as i32 / 2, height as i32 / 2),
                style,
            ))
            .map_err(plot_err)?;
            root.present().map_err(plot_err)?;
        } else {
            draw_bars(&root, &graphs, &series)?;
        }
    }
    Ok(svg)
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    graphs: &[String],
    series: &[ChartSeries],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let n = graphs.len();
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(1.0f64, |m, &x| m.max(x));
    // Headroom above the tallest bar for its label and the legend (upper right).
    let y_max = (top * 1.45).max(1.5);
    let mut chart = ChartBuilder::on(root)
        .caption(
            "spattn auto: speedup over each peer (peer time / spattn time)",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..y_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_desc("speedup (peer time / spattn time)")
        .y_label_formatter(&|y| format!("{y:.1}×"))
        .draw()
        .map_err(plot_err)?;
    let k = series.len() as f64;
    let slot = 0.8 / k;
    for (s, ChartSeries { case, values }) in series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        let bars = values.iter().enumerate().filter_map(|(g, v)| {
            v.map(|v| {
                let x0 = g as f64 + 0.1 + s as f64 * slot;
                Rectangle::new(
                    [(x0 + 0.05 * slot, 0.0), (x0 + 0.95 * slot, v)],
                    color.filled(),
                )
            })
        });
        chart
            .draw_series(bars)
            .map_err(plot_err)?
            .label(case.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        let labels = values.iter().enumerate().filter_map(|(g, v)| {
            v.map(|v| {
                let x = g as f64 + 0.1 + (s as f64 + 0.5) * slot;
                Text::new(
                    format!("{v:.2}×"),
                    (x, v),
                    TextStyle::from(("sans-serif", 12).into_font())
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )
            })
        });
        chart.draw_series(labels).map_err(plot_err)?;
    }
    // Drawn over the bars: where a bar ends below it, spattn is slower than torch.sparse.
    chart
        .draw_series(LineSeries::new(
            [(0.0, 1.0), (n as f64, 1.0)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_err)?
        .label("1× = the peer")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 12, y)], BLACK.stroke_width(1)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    let style =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in graphs.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        root.draw(&Text::new(name.clone(), (x, y + 8), style.clone()))
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}
