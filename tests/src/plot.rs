//! The peers benchmark's charts, as SVG (plotters; no fonts needed).

use anyhow::anyhow;
use plotters::prelude::*;

const SIZE: (u32, u32) = (900, 480);
const COLORS: [RGBColor; 5] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// The legend box every chart here draws, in the corner its data leaves free.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()
        .map_err(err)
}

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// Grouped bars: net CPU seconds per million packets offered, per workload and system.
pub fn cpu_per_million(path: &str, bars: &[(&str, &str, f64)]) -> anyhow::Result<()> {
    let workloads: Vec<&str> = dedup(bars.iter().map(|b| b.0));
    let systems: Vec<&str> = dedup(bars.iter().map(|b| b.1));
    let top = bars.iter().map(|b| b.2).fold(0.0f64, f64::max) * 1.15 + 1e-9;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let groups = workloads.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption("Net CPU seconds per million packets offered (minus a bare XDP_DROP)", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..groups, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(workloads.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 {
                workloads.get(i).map_or(String::new(), |w| (*w).to_string())
            } else {
                String::new()
            }
        })
        .y_desc("CPU s / M packets")
        .draw()
        .map_err(err)?;
    let width = 0.8 / systems.len() as f64;
    for (si, system) in systems.iter().enumerate() {
        let c = color(si);
        chart
            .draw_series(bars.iter().filter(|b| b.1 == *system).map(|b| {
                let g = workloads.iter().position(|w| *w == b.0).unwrap_or(0) as f64;
                let x0 = g + 0.1 + width * si as f64;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, b.2.max(0.0))], c.filled())
            }))
            .map_err(err)?
            .label(*system)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)
}

/// Cumulative packets let through over time for the boundary-burst pattern, with the bound.
pub fn boundary_burst(path: &str, series: &[(&str, Vec<f64>)], bound: &[(f64, f64)]) -> anyhow::Result<()> {
    let all: Vec<f64> = series.iter().flat_map(|(_, a)| a.iter().copied()).collect();
    let t0 = all.iter().copied().fold(f64::INFINITY, f64::min).min(0.985);
    let t1 = all.iter().copied().fold(0.0f64, f64::max).max(1.02) + 0.005;
    let top = series.iter().map(|(_, a)| a.len()).max().unwrap_or(1) as f64 * 1.1 + 1.0;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Two bursts across a second boundary: packets let through vs the GCRA bound", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(t0..t1, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("seconds since the flood started (bursts at 0.990 and 1.000)")
        .y_desc("packets let through")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(DashedLineSeries::new(
            bound.iter().copied().filter(|(t, _)| *t <= t1),
            6,
            4,
            BLACK.stroke_width(3),
        ))
        .map_err(err)?
        .label("GCRA bound floor((t + tau)/T) + 1 from the first packet")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK.stroke_width(3)));
    for (i, (name, arrivals)) in series.iter().enumerate() {
        let c = color(i);
        let mut steps = vec![(t0, 0.0)];
        for (n, t) in arrivals.iter().enumerate() {
            steps.push((*t, n as f64));
            steps.push((*t, n as f64 + 1.0));
        }
        steps.push((t1, arrivals.len() as f64));
        chart
            .draw_series(LineSeries::new(steps, c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name} ({} let through)", arrivals.len()))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    root.present().map_err(err)
}

/// State memory against distinct sources (log x).
pub fn memory(path: &str, series: &[(&str, Vec<(f64, f64)>)]) -> anyhow::Result<()> {
    let xs: Vec<f64> = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.0)).collect();
    let x0 = xs.iter().copied().fold(f64::INFINITY, f64::min).max(1.0);
    let x1 = xs.iter().copied().fold(0.0f64, f64::max).max(x0 * 10.0);
    let top = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.1)).fold(1.0f64, f64::max) * 1.15;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Kernel memory the limiting state took, by distinct sources", ("sans-serif", 18))
        .margin(15)
        .margin_right(45)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1).log_scale(), 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("distinct sources (IPv6 /64)")
        .y_desc("MiB")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.0, p.1.max(0.0))), c.stroke_width(2)).point_size(4))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)
}

/// One row count's points: (flooders, measured %, theory %).
pub type LossSeries = (String, Vec<(f64, f64, f64)>);

/// Innocent loss (%) against flooders: per series (one per row count), theory as a line and the
/// measurements as points, in the same colour.
pub fn innocent_loss(path: &str, caption: &str, series: &[LossSeries]) -> anyhow::Result<()> {
    let x1 = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.0)).fold(1.0f64, f64::max) * 1.05;
    let top = series.iter().flat_map(|(_, p)| p.iter().map(|p| p.1.max(p.2))).fold(1.0f64, f64::max) * 1.1;
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(15)
        .margin_right(45)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x1, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("flooding sources")
        .y_desc("innocent sources refused (%)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.0, p.2)), c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name}: theory (line), measured (dots)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c.stroke_width(2)));
        chart.draw_series(points.iter().map(|p| Circle::new((p.0, p.1), 4, c.filled()))).map_err(err)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(err)
}

fn dedup<'a>(it: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<&str> = Vec::new();
    for x in it {
        if !v.contains(&x) {
            v.push(x);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each chart renders to a file naming every series it was given (the bench only runs by hand).
    #[test]
    fn charts_render_with_their_series() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("limiter-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
        let read = |p: &str| std::fs::read_to_string(p);

        let cpu = path("cpu.svg");
        cpu_per_million(&cpu, &[("one source", "limiter", 0.07), ("one source", "hashlimit", 0.69)])?;
        let svg = read(&cpu)?;
        assert!(svg.contains("limiter") && svg.contains("hashlimit") && svg.contains("one source"));

        let burst = path("burst.svg");
        boundary_burst(&burst, &[("limiter", vec![0.99, 0.991, 1.0])], &[(0.99, 1.0), (1.01, 3.0)])?;
        assert!(read(&burst)?.contains("limiter (3 let through)"));

        let mem = path("memory.svg");
        memory(&mem, &[("nftables meter", vec![(1e3, 0.5), (1e6, 40.0)])])?;
        assert!(read(&mem)?.contains("nftables meter"));

        let loss = path("loss.svg");
        innocent_loss(&loss, "innocent loss", &[("D = 4".into(), vec![(5e3, 0.3, 0.48), (2e4, 25.1, 24.7)])])?;
        assert!(read(&loss)?.contains("D = 4: theory"));

        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
